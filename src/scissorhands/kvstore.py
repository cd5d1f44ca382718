"""K/V storage behind a small interface, so packed low-bit storage can be added beside it.

The cache layer decides *which* slots hold which token; a store only keeps
the tensors: it appends, scatters, reorders (compaction after an eviction),
and hands dense K/V back for the attention computation.
"""

from __future__ import annotations

import torch


class DenseKVStore:
    """K and V in the model's dtype, each of shape (B, H_kv, capacity, D)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage shaped after a chunk ``key``/``value`` (B, H_kv, T, D)."""
        b, h, _, d = key.shape
        self.keys = key.new_empty(b, h, 0, d)
        self.values = value.new_empty(b, h, 0, value.shape[-1])

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def grow(self, capacity: int) -> None:
        """Enlarge to ``capacity`` slots, keeping what is stored."""
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])  # (B, H_kv, capacity, D)
            out[:, :, : t.shape[-2]] = t
            return out

        self.keys, self.values = grown(self.keys), grown(self.values)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write a block (B, H_kv, c, D) at slots ``[start, start + c)`` of every row."""
        c = key.shape[-2]
        self.keys[:, :, start : start + c] = key
        self.values[:, :, start : start + c] = value

    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write token ``i`` (key[i]: (H_kv, D)) at slot ``slots[i]`` of row ``rows[i]``."""
        self.keys[rows, :, slots] = key
        self.values[rows, :, slots] = value

    def reorder(self, order: torch.Tensor) -> None:
        """Permute the first ``L`` slots of each (row, head) by ``order`` (B, H_kv, L)."""
        length = order.shape[-1]
        for t in (self.keys, self.values):
            idx = order.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])  # (B, H_kv, L, D)
            t[:, :, :length] = t[:, :, :length].gather(2, idx)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V of the first ``length`` slots, each (B, H_kv, length, D)."""
        return self.keys[:, :, :length], self.values[:, :, :length]

    def select_batch(self, index: torch.Tensor) -> None:
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def bytes_per_token_head(self) -> int:
        return self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
