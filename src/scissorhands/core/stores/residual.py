"""A full-precision copy of each row's newest tokens, beside packed K/V (KIVI's residual, under eviction).

Every token is still quantised once, when it is written, into the packed
store. The tail keeps, in addition, the exact K/V of each row's newest
tokens, so that a query reads its own last ``R`` positions exact and every
older slot from its packed form. That is where 4-bit error hurts most: the
newest tokens get much of each query's attention (docs/quantization.md).

Layout: ``keys``/``values`` (B, H_kv, W, D) are right-aligned per row: entry
``W - 1`` is the row's last stored slot, entry ``W - 1 - j`` the slot ``j``
before it. Rows of a ragged batch hold different numbers of tokens, and
the tail does not care: it never stores slot numbers. Two facts keep it
aligned through an eviction without touching it:

* the newest ``R`` tokens of a row are inside its recent window (the cache
  refuses ``recent < R``), so an eviction never drops them;
* an eviction keeps the kept slots in stored order, so those ``R`` tokens stay
  the row's last ``R`` slots.

Between chunks the tail holds exactly ``R`` tokens per row. While a block of
``c`` new tokens is attended it holds ``R - 1 + c``: the first query of the
block needs the ``R - 1`` tokens before it, and every query of the block its
own predecessors within it (``R + c`` when rows get different numbers of
tokens, since a row that gets none must keep its ``R``).
"""

from __future__ import annotations

import torch


class ExactTail:
    """The newest tokens of each row in the model's dtype, right-aligned; see the module docstring."""

    def __init__(self, size: int):
        self.size = size
        self.keys = torch.empty(0, 0, 0, 0)  # (B, H_kv, W, D) once allocated
        self.values = torch.empty(0, 0, 0, 0)

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        b, h = key.shape[:2]
        self.keys = key.new_empty(b, h, 0, key.shape[-1])
        self.values = value.new_empty(b, h, 0, value.shape[-1])

    @property
    def width(self) -> int:
        return self.keys.shape[-2]

    def _last(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``min(n, width)`` entries of every row."""
        w = self.width
        keep = min(n, w)
        return self.keys[:, :, w - keep:], self.values[:, :, w - keep:]

    def trim(self) -> None:
        """Keep each row's newest ``size`` entries."""
        if self.width > self.size:
            k, v = self._last(self.size)
            self.keys, self.values = k.clone(), v.clone()

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Every row gets the block ``key``/``value`` (B, H_kv, c, D) after its ``size - 1`` newest entries."""
        k, v = self._last(self.size - 1)
        self.keys = torch.cat([k, key.to(k.dtype)], dim=2)
        self.values = torch.cat([v, value.to(v.dtype)], dim=2)

    def append_at(self, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Row ``rows[i]`` gets token ``i`` (key[i]: (H_kv, D)); a row's tokens come in order, rows ascending.

        Each row keeps its ``size`` newest entries (a row that gets no token
        must still hold its newest ``size``) and gets its own new tokens after
        them, right-aligned: a row with fewer new tokens than the widest is
        shifted right, and the entries left of its data are unused.
        """
        b = self.keys.shape[0]
        counts = torch.bincount(rows, minlength=b)  # (B,) new tokens per row
        most = int(counts.max()) if rows.numel() else 0
        old_k, old_v = self._last(self.size)
        kept = old_k.shape[-2]
        first = torch.cumsum(counts, 0) - counts  # index in ``rows`` of each row's first token
        rank = torch.arange(rows.numel(), device=rows.device) - first[rows]  # (N,) order within its row
        width = kept + most
        # Place each row's tokens right after its kept entries, then shift each row right by its shortfall.
        shift = (most - counts).to(self.keys.device)  # (B,)
        col = torch.arange(width, device=self.keys.device)
        src = (col[None, :] - shift[:, None]).clamp(min=0)  # (B, W'): entry of the staged row each column takes
        out = []
        for old, new in ((old_k, key), (old_v, value)):
            staged = torch.cat([old, old.new_zeros(*old.shape[:2], most, old.shape[-1])], dim=2)  # (B, H, W', D)
            staged[rows.to(staged.device), :, kept + rank.to(staged.device)] = new.to(staged.dtype)
            idx = src[:, None, :, None].expand(-1, staged.shape[1], -1, staged.shape[-1])
            out.append(staged.gather(2, idx))
        self.keys, self.values = out

    def read(self, which: str, start: int, end: int, ends) -> torch.Tensor:
        """Exact keys (``which="keys"``) or values of slots ``[start, end)`` of each row.

        ``ends`` is each row's stored length now (an int for every row, or a
        (B,) tensor): slot ``s`` of row ``b`` is entry ``W - ends[b] + s``.
        Slots outside a row's tail come back as some other entry of that row;
        callers never choose them (they are packed for every query of the row,
        or past the row's end and masked).
        """
        t = self.keys if which == "keys" else self.values
        w = self.width
        if isinstance(ends, torch.Tensor):
            ends = ends.reshape(-1)
            if ends.numel() and bool((ends == ends[0]).all()):
                ends = int(ends[0])
        if isinstance(ends, int) and w - ends + start >= 0 and w - ends + end <= w:
            return t[:, :, w - ends + start : w - ends + end]
        ends_t = torch.as_tensor(ends, device=t.device).reshape(-1, 1)  # (B or 1, 1)
        idx = (w - ends_t + torch.arange(start, end, device=t.device)[None, :]).clamp(0, max(w - 1, 0))
        idx = idx.expand(t.shape[0], -1)[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
        return t.gather(2, idx)

    def select_batch(self, index: torch.Tensor) -> None:
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes
