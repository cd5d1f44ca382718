"""Row and slot bookkeeping for a budgeted layer: which token each stored slot holds.

Row ``b`` of a layer holds ``lengths[b]`` tokens in its first slots, in the
order they were appended (per KV head, since heads evict independently, the
slots of one row may hold different tokens). Padding is never stored, so the
rows of a left-padded batch hold exactly what each sequence would hold alone.
"""

from __future__ import annotations

import torch

from ..stores.base import gather_rows


class SlotTable:
    """Per-row stored lengths and tokens seen (CPU), and per-slot positions (device).

    Attributes
    ----------
    positions : IntTensor, shape (B, H_kv, capacity)
        Each slot's index among its sequence's real tokens (its rotary
        position), -1 for an empty slot.
    lengths : LongTensor, shape (B,), CPU
        Tokens stored per row.
    seen : LongTensor, shape (B,), CPU
        Real tokens each row has seen; the next token's position.
    uniform : (int, int) or None
        ``(stored, seen)`` when every row agrees on both, which lets decoding
        skip per-row bookkeeping.
    peak : int
        Most tokens any row ever stored; the budget bounds this.
    """

    def __init__(self, batch: int, heads: int, device: torch.device | str | None):
        self.device = device
        self.positions = torch.empty(batch, heads, 0, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long)
        self.seen = torch.zeros(batch, dtype=torch.long)
        self.uniform: tuple[int, int] | None = (0, 0)
        self.peak = 0

    @property
    def length(self) -> int:
        """Longest row's stored length (the slots any row uses)."""
        return 0 if self.lengths.numel() == 0 else int(self.lengths.max())

    @property
    def capacity(self) -> int:
        return self.positions.shape[-1]

    def aligned(self, lengths: torch.Tensor) -> bool:
        """Do all rows store ``lengths`` alike and sit at the same step? Then scalar fast paths apply."""
        if lengths.numel() == 1:  # one row is always aligned (no tensor ops: this runs several times per event)
            return True
        return bool((lengths == lengths[0]).all()) and bool((self.seen == self.seen[0]).all())

    def uniform_state(self) -> tuple[int, int]:
        """``(stored, seen)`` shared by every row; only valid when rows are aligned."""
        if self.uniform is None:
            raise RuntimeError("rows are not aligned: the per-token fast path does not apply")
        return self.uniform

    def sync_uniform(self) -> None:
        aligned = self.lengths.numel() > 0 and self.aligned(self.lengths)
        self.uniform = (int(self.lengths[0]), int(self.seen[0])) if aligned else None

    def resize(self, capacity: int) -> None:
        """Set the slot axis to ``capacity``; new slots are empty."""
        keep = min(self.capacity, capacity)
        positions = self.positions.new_full((*self.positions.shape[:2], capacity), -1)  # (B, H_kv, capacity)
        positions[:, :, :keep] = self.positions[:, :, :keep]
        self.positions = positions

    def place_block(self, start: int, count: int) -> None:
        """Record ``count`` new tokens at slots ``[start, start + count)`` of every row (all rows aligned)."""
        pos = int(self.seen[0]) + torch.arange(count, dtype=torch.int32, device=self.device)
        self.positions[:, :, start : start + count] = pos

    def place_tokens(self, rows: torch.Tensor, cum: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Record scattered new tokens; return their slots.

        rows, cols : (N,) CPU, the row and block column of each real token;
        cum : (B, c) CPU, real tokens of the block up to and including each column.
        """
        slots = self.lengths[rows] + cum[rows, cols] - 1  # (N,)
        pos = (self.seen[rows] + cum[rows, cols] - 1).to(torch.int32)
        self.positions[rows.to(self.device), :, slots.to(self.device)] = pos.to(self.device)[:, None]
        return slots

    def advance(self, added: torch.Tensor) -> None:
        """Count ``added`` (B,) new tokens per row as stored and seen."""
        self.lengths += added
        self.seen += added
        self.peak = max(self.peak, self.length)
        self.sync_uniform()

    def advance_uniform(self) -> None:
        """Decode fast path: one token per row, every row aligned."""
        length, seen = self.uniform_state()
        self.lengths += 1
        self.seen += 1
        self.uniform = (length + 1, seen + 1)
        self.peak = max(self.peak, length + 1)

    def compact(self, keep: torch.Tensor, dropped: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Reorder the first ``L`` slots by ``keep`` (B, H_kv, L) and forget ``dropped`` (B,) tokens per row.

        With ``rows`` (a device index) only those rows are reordered, and ``keep`` is (len(rows), H_kv, L).
        """
        length = keep.shape[-1]
        gather_rows(self.positions, keep, rows)
        self.lengths -= dropped
        slot = torch.arange(length, device=self.device)
        empty = slot[None, :] >= self.lengths.to(self.device)[:, None]  # (B, L)
        self.positions[:, :, :length].masked_fill_(empty[:, None, :], -1)
        self.sync_uniform()

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (any order, repeats allowed)."""
        self.positions = self.positions.index_select(0, index.to(self.device))
        cpu = index.cpu()
        self.lengths = self.lengths.index_select(0, cpu)
        self.seen = self.seen.index_select(0, cpu)
        self.sync_uniform()

    def load_row(self, b: int, positions: torch.Tensor, seen: int) -> None:
        """Row ``b`` now holds the tokens at ``positions`` (H_kv, L), in stored order, after ``seen`` tokens."""
        length = positions.shape[-1]
        self.positions[b] = -1
        self.positions[b, :, :length] = positions.to(self.positions)
        self.lengths[b] = length
        self.seen[b] = seen
        self.peak = max(self.peak, length)
        self.sync_uniform()

    def row(self, b: int) -> torch.Tensor:
        """Positions stored for row ``b``, shape (H_kv, lengths[b]), in stored order."""
        return self.positions[b, :, : int(self.lengths[b])]
