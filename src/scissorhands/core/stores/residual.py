"""A full-precision copy of each row's newest tokens, beside a lossy store (KIVI's residual, under eviction).

:class:`ResidualStore` wraps any store (the packed one by default). Every
token is still written once into the wrapped store (quantised once, for a
packed one). The tail keeps, in addition, the exact K/V of each row's newest
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

from .base import KVStore


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


class ResidualStore(KVStore):
    """Any store, plus each row's newest ``size`` tokens exact: a query reads its last ``size`` tokens from here.

    Everything else is the wrapped store's. The tail costs ``size`` tokens in
    the model's dtype per row and KV head (``residual_bytes``). The layer
    refuses a residual larger than its recent window, so an eviction never
    touches the tail's tokens (see the module docstring).

    Parameters
    ----------
    inner : KVStore
        The store every token is written to.
    size : int
        Newest tokens of each row kept exact (>= 1).
    """

    def __init__(self, inner: KVStore, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"kv_residual: must be an integer >= 1 for a residual store, got {size!r}")
        self.inner, self.residual = inner, size
        self.name = f"{inner.name}+residual"  # type: ignore[misc]  # per instance: what it wraps
        self.read_tile = inner.read_tile
        self.tail = ExactTail(size)

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.inner.allocate(key, value)
        self.tail.allocate(key, value)

    def reset(self) -> None:
        self.inner.reset()
        self.tail = ExactTail(self.residual)

    def resize(self, capacity: int) -> None:
        self.inner.resize(capacity)

    @property
    def wants_positions(self) -> bool:  # type: ignore[override]
        return self.inner.wants_positions

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        if positions is None:
            self.inner.write(start, key, value)
        else:
            self.inner.write(start, key, value, positions=positions)
        self.tail.append(key, value)

    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        if positions is None:
            self.inner.write_at(rows, slots, key, value)
        else:
            self.inner.write_at(rows, slots, key, value, positions=positions)
        self.tail.append_at(rows, key, value)

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        self.inner.reorder(order, rows)
        # The newest ``residual`` tokens are recent, hence kept, and stay the last slots: the tail holds.
        self.tail.trim()

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.read(length)

    def read_keys(self, start: int, end: int) -> torch.Tensor:
        return self.inner.read_keys(start, end)

    def read_values(self, start: int, end: int) -> torch.Tensor:
        return self.inner.read_values(start, end)

    def read_exact_keys(self, start: int, end: int, ends) -> torch.Tensor:
        """Exact keys of slots ``[start, end)``; ``ends``: each row's stored length (see :meth:`ExactTail.read`)."""
        return self.tail.read("keys", start, end, ends)

    def read_exact_values(self, start: int, end: int, ends) -> torch.Tensor:
        return self.tail.read("values", start, end, ends)

    def tiered(self):
        return self.inner.tiered()

    def settle(self) -> None:
        self.inner.settle()
        self.tail.trim()

    def select_batch(self, index: torch.Tensor) -> None:
        self.inner.select_batch(index)
        self.tail.select_batch(index)

    def nbytes(self) -> int:
        return self.inner.nbytes() + self.tail.nbytes()

    def data_bytes(self) -> int:
        return self.inner.data_bytes()

    def scale_bytes(self) -> int:
        return self.inner.scale_bytes()

    def residual_bytes(self) -> int:
        return self.tail.nbytes()

    def bytes_per_token_head(self) -> int:
        return self.inner.bytes_per_token_head()
