"""One width of a tiered store above its base: a pool of entries, and which entry each slot holds.

A :class:`~.tiered.TieredKVStore` keeps every token's base plane in its slot; each width above the base
is a :class:`WidthPool` of ``cap`` entries per (row, KV head), sized by the width's share of the layer's
budget. An entry holds the width's plane of a token's codes (the bits it adds over the width below), or,
for 16 bits, the token's dense K and V. Each slot points at its entry, or at none (-1). Demoting a token
releases its entries; evicting it moves only its pointer with the slot, and the pool stays where it is.
"""

from __future__ import annotations

import torch

from .packed import packed_width


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
