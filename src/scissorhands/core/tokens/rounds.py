"""Eviction in rounds: a full layer chooses ``drop`` victims at once, and they leave one per new token.

The per-step semantics (``rounds=False``) drop ``drop`` tokens when an append
would exceed the budget, so a full layer's stored count falls to ``B - drop``
and climbs back. In rounds, a full row with no victim pending scores its
tokens and marks its ``drop`` lowest (by the rules of
:func:`~scissorhands.core.tokens.selection.lowest`: recent window, protected spans,
older first among equals) as victims, ranked by position, oldest first. Each
new token then evicts the oldest pending victim, so the row holds exactly
``B`` tokens, and the victims are still attended until they leave.

This is what a sliding window of ``B`` slots does when the victims are moved
into the slots that leave the window next: the vLLM adapter's eviction, where
scoring runs once per ``drop`` steps and the window frees whole blocks with no
move per step (:mod:`scissorhands.vllm.rounds`). The transformers cache runs the
same mode, so both keep the same positions.

:class:`RoundState` is a :class:`~scissorhands.core.tokens.state.TokenState`: each
slot's leave rank (-1: not a victim) moves with the slot on every compaction.
"""

from __future__ import annotations

import torch

from ..stores.base import gather_rows
from .state import TokenState


class RoundState(TokenState):
    """Each stored slot's rank among its row's pending victims (0 leaves first), -1 for a token that stays."""

    compacts_rows = True

    def __init__(self):
        self.reset()

    @property
    def allocated(self) -> bool:
        return self._allocated

    def reset(self) -> None:
        self.rank = torch.empty(0, 0, 0, dtype=torch.int32)
        self._allocated = False

    def allocate(self, batch: int, heads: int, capacity: int, group: int, device, dtype=None) -> None:
        self.rank = torch.full((batch, heads, capacity), -1, dtype=torch.int32, device=device)
        self._allocated = True

    def resize(self, capacity: int) -> None:
        old = self.rank
        self.rank = old.new_full((*old.shape[:2], capacity), -1)
        keep = min(capacity, old.shape[-1])
        self.rank[..., :keep] = old[..., :keep]

    def clear(self, start: int, end: int) -> None:
        self.rank[..., start:end] = -1

    def clear_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        self.rank[rows, :, slots] = -1

    def compact(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        gather_rows(self.rank, keep, rows)

    def select_batch(self, index: torch.Tensor) -> None:
        self.rank = self.rank.index_select(0, index)

    def load_row(self, row: int, other: TokenState, other_row: int, length: int) -> None:
        assert isinstance(other, RoundState)
        self.rank[row] = -1
        self.rank[row, :, :length] = other.rank[other_row, :, :length]

    def nbytes(self) -> int:
        return self.rank.numel() * self.rank.element_size()

    def bytes_per_token_head(self) -> int:
        return self.rank.element_size() if self._allocated else 0

    # -- rounds ----------------------------------------------------------------------------------------
    def pending(self, lengths: torch.Tensor) -> torch.Tensor:
        """Victims still stored per row (B,), CPU (every KV head has as many)."""
        length = int(lengths.max()) if lengths.numel() else 0
        head = self.rank[:, 0, :length]
        stored = torch.arange(length, device=head.device)[None, :] < lengths.to(head.device)[:, None]
        return ((head >= 0) & stored).sum(dim=1).cpu()

    def choose(self, victims: torch.Tensor) -> None:
        """Mark ``victims`` (B, H_kv, L) bool; in stored (= position) order they leave oldest first."""
        length = victims.shape[-1]
        rank = victims.to(torch.int32).cumsum(dim=-1, dtype=torch.int32) - 1
        self.rank[..., :length] = torch.where(victims, rank, self.rank[..., :length])

    def next_out(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, L) float: 0 at each head's next victim (its lowest rank), 1 elsewhere."""
        length = int(lengths.max())
        rank = self.rank[..., :length]
        stored = torch.arange(length, device=rank.device)[None, None, :] < lengths.to(rank.device)[:, None, None]
        live = (rank >= 0) & stored
        big = torch.iinfo(torch.int32).max
        first = torch.where(live, rank, big).amin(dim=-1, keepdim=True)
        return (~(live & (rank == first))).to(torch.float32)
