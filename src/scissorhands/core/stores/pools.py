"""What a tiered store's widths hold: the base plane in every slot, and above it pools of entries.

A :class:`~.tiered.TieredKVStore` keeps every token's base plane in its slot (:class:`BasePlane`); each width
above the base is a :class:`WidthPool` of ``cap`` entries per (row, KV head), sized by the width's share of the layer's
budget. An entry holds the width's plane of a token's codes (the bits it adds over the width below), or,
for 16 bits, the token's dense K and V. Each slot points at its entry, or at none (-1). Demoting a token
releases its entries; evicting it moves only its pointer with the slot, and the pool stays where it is.
"""

from __future__ import annotations

import torch

from .base import gather_rows
from .packed import pack, packed_width


def resized(t: torch.Tensor, capacity: int, fill=0) -> torch.Tensor:
    """``t`` (B, H_kv, slots, ...) with ``capacity`` slots: the first ones kept, new ones at ``fill``."""
    out = t.new_full((*t.shape[:2], capacity, *t.shape[3:]), fill)
    keep = min(capacity, t.shape[2])
    out[:, :, :keep] = t[:, :, :keep]
    return out


def rank_in_row(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Each of N tokens' order among the tokens of its row, ``rows`` (N,) sorted by row: (N,)."""
    counts = torch.bincount(rows, minlength=n_rows)
    first = torch.cumsum(counts, 0) - counts
    return torch.arange(rows.numel(), device=rows.device) - first[rows]


class BasePlane:
    """What every slot of a tiered store holds, on the slot axis: the bottom width's bit plane of K and of V
    (``k``, ``v``: uint8, (B, H_kv, capacity, W)) and their per-group float16 scales and zero-points."""

    PARTS = ("k", "v", "scale_k", "zero_k", "scale_v", "zero_v")

    def __init__(self, bits: int):
        self.bits = bits
        self.k = self.v = self.scale_k = self.zero_k = self.scale_v = self.zero_v = torch.empty(0)

    def allocate(self, b: int, h: int, dims: tuple[int, int], groups: tuple[int, int], device) -> None:
        (dk, dv), (gk, gv) = dims, groups
        self.k = torch.zeros(b, h, 0, packed_width(dk, self.bits), dtype=torch.uint8, device=device)
        self.v = torch.zeros(b, h, 0, packed_width(dv, self.bits), dtype=torch.uint8, device=device)
        self.scale_k = torch.zeros(b, h, 0, dk // gk, dtype=torch.float16, device=device)
        self.zero_k = torch.zeros_like(self.scale_k)
        self.scale_v = torch.zeros(b, h, 0, dv // gv, dtype=torch.float16, device=device)
        self.zero_v = torch.zeros_like(self.scale_v)

    @property
    def capacity(self) -> int:
        return self.k.shape[-2] if self.k.dim() == 4 else 0

    def map(self, fn) -> None:
        """Replace every part ``t`` by ``fn(t)``."""
        for name in self.PARTS:
            setattr(self, name, fn(getattr(self, name)))

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        for name in self.PARTS:
            gather_rows(getattr(self, name), order, rows)

    def put(self, index, top: int, codes_k, codes_v) -> None:
        """Store tokens' top-width ``(codes, scale, zero)`` of K and V at ``index`` of the slot axis (a slice,
        or ``(rows, :, slots)``), keeping the codes' top ``bits`` bits."""
        (qk, sk, zk), (qv, sv, zv) = codes_k, codes_v
        self.k[index] = pack(qk >> (top - self.bits), self.bits)
        self.v[index] = pack(qv >> (top - self.bits), self.bits)
        self.scale_k[index], self.zero_k[index], self.scale_v[index], self.zero_v[index] = sk, zk, sv, zv

    def data_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def scale_bytes(self) -> int:
        return sum(t.nbytes for t in (self.scale_k, self.zero_k, self.scale_v, self.zero_v))

    def bytes_per_slot(self) -> int:
        """One slot's bytes: its planes, scales and zero-points (float16)."""
        return self.k.shape[-1] + self.v.shape[-1] + 2 * sum(
            t.shape[-1] for t in (self.scale_k, self.zero_k, self.scale_v, self.zero_v))


class WidthPool:
    """The entries of one width: ``k``/``v`` (B, H_kv, cap, W) planes or dense rows, ``where`` (B, H_kv,
    capacity) each slot's entry or -1, ``used`` (B, H_kv, cap) which entries are taken."""

    def __init__(self, bits: int, cap: int, below: int, key: torch.Tensor, value: torch.Tensor,
                 index: torch.dtype):
        b, h, _, dk = key.shape
        dv, dev = value.shape[-1], key.device
        self.bits, self.cap, self.dense = bits, cap, bits == 16
        self.plane = 0 if self.dense else bits - below  # bits of the code this pool adds; 0 for dense rows
        if self.dense:
            self.k, self.v = key.new_zeros(b, h, cap, dk), value.new_zeros(b, h, cap, dv)
        else:
            self.k = torch.zeros(b, h, cap, packed_width(dk, self.plane), dtype=torch.uint8, device=dev)
            self.v = torch.zeros(b, h, cap, packed_width(dv, self.plane), dtype=torch.uint8, device=dev)
        self.where = torch.full((b, h, 0), -1, dtype=index, device=dev)
        self.used = torch.zeros(b, h, cap, dtype=torch.bool, device=dev)

    @staticmethod
    def bytes_for(bits: int, below: int, cap: int, shape, tokens: int, index: int) -> int:
        """The pool's byte model per KV head: ``cap`` entries with their occupancy, and one index per slot."""
        entry = (shape.head_dim_k + shape.head_dim_v) * shape.itemsize if bits == 16 else \
            packed_width(shape.head_dim_k, bits - below) + packed_width(shape.head_dim_v, bits - below)
        return cap * (entry + 1) + tokens * index

    def free_entries(self, count: int) -> torch.Tensor:
        """Each (row, head)'s first ``count`` free entries, in index order (B, H_kv, count).

        Past the free ones come indices beyond the pool (``cap`` and up), so writing into a full pool, which
        the layer's demotion rules out, fails loudly in the index instead of overwriting a live entry.
        """
        ar = torch.arange(self.cap, device=self.used.device)
        key = torch.where(self.used, ar + self.cap, ar)
        if count == 1:  # a decode step: no sort
            return key.min(dim=-1, keepdim=True).values
        return key.sort(dim=-1).values[:, :, :count]

    def put(self, start: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Take free entries for a block of new tokens at slots ``[start, start + c)`` of every row."""
        entries = self.free_entries(k_new.shape[-2])  # (B, H_kv, c)
        self.used.scatter_(2, entries, True)
        self.k.scatter_(2, entries[..., None].expand(-1, -1, -1, self.k.shape[-1]), k_new)
        self.v.scatter_(2, entries[..., None].expand(-1, -1, -1, self.v.shape[-1]), v_new)
        self.where[:, :, start:start + k_new.shape[-2]] = entries.to(self.where.dtype)

    def put_at(self, r: torch.Tensor, hh: torch.Tensor, rank: torch.Tensor, slots: torch.Tensor,
               k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Take entries for single tokens: token ``i`` of row ``r[i]`` takes its row's ``rank[i]``-th free one."""
        entries = self.free_entries(self.cap)[r, hh, rank[:, None]]  # (N, H_kv)
        self.used[r, hh, entries] = True
        self.k[r, hh, entries], self.v[r, hh, entries] = k_new, v_new
        self.where[r, hh, slots[:, None]] = entries.to(self.where.dtype)

    def release(self, gone: torch.Tensor) -> None:
        """Free the entries the slots ``gone`` (B, H_kv, L) hold; those slots then hold none."""
        length = gone.shape[-1]
        where = self.where[:, :, :length]
        gone = gone & (where >= 0)
        hits = torch.zeros(self.used.shape, dtype=torch.int32, device=gone.device)
        hits.scatter_add_(2, where.clamp(min=0).long(), gone.to(torch.int32))
        self.used &= hits == 0
        where.masked_fill_(gone, -1)

    def entries(self, which: int, where: torch.Tensor) -> torch.Tensor:
        """The K (``which`` 0) or V (1) entries (B, H_kv, n, W) the slots' ``where`` (B, H_kv, n) point at
        (entry 0 for none).

        One ``index_select`` of whole rows over the flattened (row, head, entry) axis: cheaper than a gather
        along the entry axis with an index expanded over the row's bytes.
        """
        data = (self.k, self.v)[which]
        b, h, cap, width = data.shape
        base = torch.arange(b * h, device=where.device).view(b, h, 1) * cap
        flat = (where.clamp(min=0).long() + base).reshape(-1)
        return data.reshape(b * h * cap, width).index_select(0, flat).view(b, h, -1, width)

    def select_batch(self, index: torch.Tensor) -> None:
        self.k, self.v, self.where, self.used = (t.index_select(0, index) for t in (self.k, self.v, self.where,
                                                                                      self.used))

    def data_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def bookkeeping_bytes(self) -> int:
        """Each slot's entry and each entry's occupancy."""
        return self.where.nbytes + self.used.nbytes
