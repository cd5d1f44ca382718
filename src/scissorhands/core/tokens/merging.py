"""Merging evicted tokens into kept ones instead of dropping them (the CaM / D2O family), as an option.

When a token is evicted, its value is folded into the kept token of the same
row and KV head whose key is most similar (cosine), as a mass-weighted average,
and the kept token's *mass* grows by the evicted one's. Attention then adds
``log(mass)`` to that slot's logit, so a slot standing for two near-identical
tokens gets the attention both would have had. With no eviction every mass is
1 and nothing changes. The budget is untouched: merging adds no slot.
"""

from __future__ import annotations

import torch

from ..stores.base import gather_rows
from .state import TokenState


class MergeState(TokenState):
    """The mass of each stored slot (B, H_kv, capacity), float32; fresh tokens have mass 1."""

    compacts_rows = True

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.mass = torch.ones(0, 0, 0)
        self._allocated = False

    @property
    def allocated(self) -> bool:
        return self._allocated

    def allocate(self, batch, heads, capacity, group, device, dtype) -> None:
        self.mass = torch.ones(batch, heads, capacity, device=device)
        self._allocated = True

    def resize(self, capacity: int) -> None:
        keep = min(capacity, self.mass.shape[-1])
        mass = self.mass.new_ones(*self.mass.shape[:2], capacity)
        mass[..., :keep] = self.mass[..., :keep]
        self.mass = mass

    def clear(self, start: int, end: int) -> None:
        self.mass[..., start:end] = 1.0

    def clear_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.mass[rows, :, slots] = 1.0

    def compact(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        gather_rows(self.mass, keep, rows)  # mass: (B, H_kv, capacity)

    def select_batch(self, index: torch.Tensor) -> None:
        self.mass = self.mass.index_select(0, index)

    def nbytes(self) -> int:
        return self.mass.nbytes

    def bytes_per_token_head(self) -> int:
        return self.mass.element_size()

    def bias(self, length: int) -> torch.Tensor:
        """Logit bias of the first ``length`` slots, ``log(mass)``, shape (B, H_kv, length)."""
        return self.mass[..., :length].log()

    def fold(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, lengths: torch.Tensor,
             n_drop: torch.Tensor) -> torch.Tensor:
        """Fold the values of the slots about to be dropped into their nearest kept slots.

        Parameters
        ----------
        keys, values : Tensor, shape (B, H_kv, L, D)
            The stored K and V (dense), in slot order.
        keep : LongTensor, shape (B, H_kv, L)
            From :func:`~scissorhands.core.tokens.selection.keep_order`: kept slots first, then dropped.
        lengths, n_drop : LongTensor, shape (B,)

        Returns
        -------
        Tensor, shape (B, H_kv, L, D)
            The new values, in slot order (kept slots blended, others unchanged); masses are updated.
        """
        length = keep.shape[-1]
        device = keys.device
        ranks = torch.arange(length, device=device)
        rank = torch.empty_like(keep).scatter_(2, keep, ranks.expand_as(keep))  # (B, H_kv, L): each slot's rank
        kept_n = (lengths - n_drop).to(device)[:, None, None]
        kept = rank < kept_n  # (B, H_kv, L)
        dropped = ~kept & (rank < lengths.to(device)[:, None, None])
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        sim = unit @ unit.transpose(-1, -2)  # (B, H_kv, L, L): slot i against slot j
        sim = sim.masked_fill(~kept[:, :, None, :], float("-inf"))
        target = sim.argmax(dim=-1)  # (B, H_kv, L): nearest kept slot of each slot
        mass = self.mass[..., :length]
        moved = mass * dropped  # (B, H_kv, L)
        num = mass[..., None] * values.float()
        num.scatter_add_(2, target[..., None].expand_as(num), moved[..., None] * values.float())
        den = mass.scatter_add(2, target, moved)
        blended = torch.where(kept[..., None], num / den[..., None], values.float()).to(values.dtype)
        self.mass[..., :length] = torch.where(kept, den, mass)
        return blended
