"""Demotion before eviction: each stored token has a bit width, and the least important lose bits first.

A :class:`TieredKVStore` keeps K/V at a chain of widths, for example
16 → 4 → 2 or 8 → 4 → 2 bits. A token is written at the top of the chain.
When more tokens hold a width than that width's share of the layer budget
allows, the layer demotes the lowest-scoring ones a step down; eviction then
only ever drops tokens at the bottom of the chain (see
:class:`~scissorhands.core.layer.budgeted.BudgetedKV`, "tiers").

Layout: bit planes, so that a demotion re-packs nothing.

* Every token is quantised once, when it is written, at the widest packed
  width ``w_top`` of the chain, in groups along the head dimension as the
  packed store does (:mod:`.packed`): an integer code ``q`` in
  ``[0, 2**w_top)`` per element, and one float16 scale and zero-point per
  group.
* The *base plane* holds the top ``w_base`` bits of ``q`` for every slot.
* Each packed width above the base adds a *plane*: the next
  ``w - w_below`` bits of ``q``. A plane lives in a pool of the width's share
  of the budget; each slot holds an index into that pool, or -1. A token at
  width ``w`` holds an entry in every pool down to the base.
* A 16-bit top of the chain is a pool of dense K/V rows in the model's dtype.

A token at width ``w`` reads back as its top ``w`` bits with the missing low
bits at their midpoint: ``(code_w * 2**k + (2**k - 1) / 2) * scale + zero``
with ``k = w_top - w``. That is an asymmetric ``w``-bit quantisation of the
same group (its levels are the centres of ``2**w`` equal bins), so a demoted
token is as exact as one written at ``w`` bits, with no second rounding.
Demoting a token frees its pool entries; nothing else moves. An eviction
permutes the base plane, the scales and the pool indices with the slots, and
the pools stay where they are.

Bytes are what is allocated: the base plane and scales for every slot, each
pool at its share of the budget, and the pool indices and occupancy maps.
"""

from __future__ import annotations

import torch

from ..settings.storage import TieredSettings
from ..settings.tiers import check_tiers, parse_tiers, share_caps, tier_caps
from .base import KVStore, gather_rows
from .packed import (
    PackedKVStore,
    centred,
    check_key_center,
    group_for,
    pack,
    quantize_codes,
    unpack,
)
from .pools import BasePlane, WidthPool, rank_in_row, resized


class TieredKVStore(KVStore):
    """K/V at a chain of bit widths; the layer demotes the least important tokens a width down before evicting.

    Parameters
    ----------
    bits : {2, 4}
        The bottom of the chain: every token ends there before it may be evicted.
    tiers : sequence of (bits, share)
        The widths above ``bits``, widest first (16, 8 or 4), each with the
        most tokens of the layer's budget, as a fraction, that may hold it or a
        wider one. Packed widths step through 8, 4, 2 one by one.
    group_size, read_tile, key_center
        As for :class:`~.packed.PackedKVStore`.

    The layer tells the store its budget (:meth:`bind`), which turns the
    shares into pool sizes. Every slot's base plane is a :class:`~.pools.BasePlane`, each width above it a
    :class:`~.pools.WidthPool`.
    """

    name = "tiered"
    Settings = TieredSettings  # the packed store's settings and kv_demote: valid only with this store

    def __init__(self, bits: int = 2, tiers=((4, 0.5),), group_size: int = 32, read_tile: int = 512,
                 key_center: torch.Tensor | None = None):
        tiers = parse_tiers(tiers)
        check_tiers(tiers, bits)
        if isinstance(read_tile, bool) or not isinstance(read_tile, int) or read_tile < 1:
            raise ValueError(f"kv_tile: must be an integer >= 1, got {read_tile!r}")
        self.bits, self.tiers, self.group_size, self.read_tile = bits, tiers, group_size, read_tile
        if key_center is not None and not isinstance(key_center, torch.Tensor):
            raise ValueError("kv_key_centers: rotary centres (a format-2 file) are read by the packed store only; "
                             "kv_demote's tiered store takes fixed centres (a format-1 file)")
        self.key_center = key_center
        packed = [b for b, _ in tiers if b < 16] + [bits]
        self.top = packed[0]  # the width every token is quantised at
        self.budget: int | None = None
        self.reset()

    # -- the chain -----------------------------------------------------------------------------
    @property
    def widths(self) -> tuple[int, ...]:
        """Every width of the chain, widest first, the base last."""
        return (*(b for b, _ in self.tiers), self.bits)

    def bind(self, budget: int, recent: int, drop: int) -> None:
        """Size the pools for a layer of this budget; each must hold the recent window and a drop's worth more."""
        caps = tier_caps(self.tiers, budget, recent, drop)
        self.budget, self.caps = budget, tuple(caps)

    def tiered(self) -> TieredKVStore:
        return self

    @property
    def tier_caps(self) -> tuple[int, ...]:
        """Most tokens per (row, KV head) at each width above the base, widest first (after :meth:`bind`)."""
        if self.budget is None:
            raise RuntimeError("TieredKVStore: used before bind")
        return self.caps

    # -- allocation and bytes ------------------------------------------------------------------------
    def reset(self) -> None:
        self.pools: list[WidthPool] = []
        self.plane = BasePlane(self.bits)
        self.dtype = torch.float32
        self.center: torch.Tensor | None = None

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        b, h, _, dk = key.shape
        check_key_center(self.key_center, h, dk)
        caps = self.tier_caps
        self.dtype, self.dims = key.dtype, (dk, value.shape[-1])
        self.groups = (group_for(dk, self.group_size), group_for(self.dims[1], self.group_size))
        self.center = None if self.key_center is None else self.key_center.to(key.device, torch.float32)[:, None, :]
        self.plane.allocate(b, h, self.dims, self.groups, key.device)
        index = torch.int16 if max(caps) < 2**15 else torch.int32
        self.pools = [WidthPool(bits, cap, below, key, value, index)
                      for (bits, _), cap, below in zip(self.tiers, caps, self.widths[1:])]

    def data_bytes(self) -> int:
        """K/V element data: the base plane of every slot and every pool (planes, or dense rows)."""
        return self.plane.data_bytes() + sum(p.data_bytes() for p in self.pools)

    def scale_bytes(self) -> int:
        """Scales and zero-points, key centres, and the tiers' bookkeeping (each slot's pool entries, occupancy)."""
        own = self.plane.scale_bytes() + (0 if self.center is None else self.center.nbytes)
        return own + sum(p.bookkeeping_bytes() for p in self.pools)

    def nbytes(self) -> int:
        return self.data_bytes() + self.scale_bytes()

    def bytes_per_token_head(self) -> int:
        """What one slot costs beside the pools: its base plane, scales and zero-points, and pool indices."""
        return self.plane.bytes_per_slot() + sum(p.where.element_size() for p in self.pools)

    @classmethod
    def bytes_for(cls, settings, shape, tokens: int) -> int:
        """Every slot's base plane with its scales, then each width's pool at its share (planes, or dense rows for
        16 bits) with its occupancy map, and one pool index per slot and width."""
        total = PackedKVStore.bytes_for(settings, shape, tokens)
        chain = [b for b, _ in settings.kv_demote] + [int(settings.kv_bits or 16)]
        caps = share_caps(settings.kv_demote, tokens)
        index = 2 if max(caps) < 2**15 else 4
        for (bits, _), below, cap in zip(settings.kv_demote, chain[1:], caps):
            total += WidthPool.bytes_for(bits, below, cap, shape, tokens, index)
        return total

    @property
    def capacity(self) -> int:
        return self.plane.capacity

    def resize(self, capacity: int) -> None:
        self.plane.map(lambda t: resized(t, capacity))
        for pool in self.pools:
            pool.where = resized(pool.where, capacity, -1)  # each slot's entry moves with the slot; the pools stay

    # -- writing -----------------------------------------------------------------------------------
    def _codes(self, key: torch.Tensor, value: torch.Tensor):
        """(codes, scale, zero) of K and of V at the top width; ``key`` (..., H_kv, D) with centres taken off."""
        return (quantize_codes(centred(key, self.center), self.top, self.groups[0]),
                quantize_codes(value, self.top, self.groups[1]))

    def _entry(self, pool: WidthPool, key: torch.Tensor, value: torch.Tensor, qk: torch.Tensor, qv: torch.Tensor):
        """What ``pool`` keeps of new tokens: dense rows, or its plane of K's and V's top-width codes (the
        ``pool.plane`` bits below its width's top bits)."""
        if pool.dense:
            return key.to(pool.k.dtype), value.to(pool.v.dtype)
        return tuple(pack((code >> (self.top - pool.bits)) & (2**pool.plane - 1), pool.plane) for code in (qk, qv))

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        codes = self._codes(key, value)
        self.plane.put((slice(None), slice(None), slice(start, start + key.shape[-2])), self.top, *codes)
        for pool in self.pools:
            pool.put(start, *self._entry(pool, key, value, codes[0][0], codes[1][0]))

    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        codes = self._codes(key, value)  # (N, H_kv, ·)
        self.plane.put((rows, slice(None), slots), self.top, *codes)
        rank = rank_in_row(rows, self.plane.k.shape[0])  # (N,) the token's order within its row
        r, hh = rows[:, None], torch.arange(key.shape[1], device=rows.device)[None, :]
        for pool in self.pools:
            pool.put_at(r, hh, rank, slots, *self._entry(pool, key, value, codes[0][0], codes[1][0]))

    # -- demotion and eviction ------------------------------------------------------------------------
    def demote(self, level: int, slots: torch.Tensor) -> None:
        """Slots ``slots`` (B, H_kv, L) bool, at width ``widths[level]`` or wider, fall to ``widths[level + 1]``."""
        for pool in self.pools[: level + 1]:
            pool.release(slots)

    def forget(self, lengths: torch.Tensor) -> None:
        """Slots at or past each row's length (B,) hold nothing now: free their pool entries."""
        cap, k = self.capacity, self.plane.k
        if not self.pools or cap == 0:
            return
        dead = torch.arange(cap, device=k.device)[None, :] >= lengths.to(k.device)[:, None]
        dead = dead[:, None, :].expand(-1, k.shape[1], -1)
        for pool in self.pools:
            pool.release(dead)

    def head_counts(self) -> torch.Tensor:
        """Tokens per (row, KV head) at each width above the base, widest first: (B, H_kv, levels)."""
        return torch.stack([pool.used.sum(dim=-1) for pool in self.pools], dim=-1)

    def tier_mask(self, length: int) -> torch.Tensor:
        """Which of the first ``length`` slots hold a width above the base (B, H_kv, L) bool."""
        return self.pools[-1].where[:, :, :length] >= 0

    def slot_widths(self, length: int) -> torch.Tensor:
        """The width each of the first ``length`` slots holds now (B, H_kv, L)."""
        k = self.plane.k
        widths = torch.full(k.shape[:2] + (length,), self.bits, dtype=torch.int16, device=k.device)
        for pool in reversed(self.pools):  # narrowest first, so a wider width overwrites
            widths.masked_fill_(pool.where[:, :, :length] >= 0, pool.bits)
        return widths

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        self.plane.reorder(order, rows)
        for pool in self.pools:
            gather_rows(pool.where, order, rows)

    def select_batch(self, index: torch.Tensor) -> None:
        self.plane.map(lambda t: t.index_select(0, index))
        for pool in self.pools:
            pool.select_batch(index)

    # -- reading ---------------------------------------------------------------------------------------
    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return read_slots(self, 0, 0, length), read_slots(self, 1, 0, length)

    def read_keys(self, start: int, end: int) -> torch.Tensor:
        return read_slots(self, 0, start, end)

    def read_values(self, start: int, end: int) -> torch.Tensor:
        return read_slots(self, 1, start, end)

    @classmethod
    def from_settings(cls, settings, key_center: torch.Tensor | None = None) -> TieredKVStore:
        return cls(settings.kv_bits, settings.kv_demote, settings.kv_group_size, settings.kv_tile, key_center)


def read_slots(store: TieredKVStore, which: int, start: int, end: int) -> torch.Tensor:
    """Dense K (``which`` 0) or V (1) of a tiered store's slots ``[start, end)``: (B, H_kv, n, D).

    Each slot reads back at the width it holds now: its base plane, every plane it still holds above it, and
    the bits it lost at their midpoint."""
    slots = store.plane
    base = (slots.k, slots.v)[which][:, :, start:end]
    scale = (slots.scale_k, slots.scale_v)[which][:, :, start:end]
    zero = (slots.zero_k, slots.zero_v)[which][:, :, start:end]
    dim, group = store.dims[which], store.groups[which]
    # Built on the top width's scale in float32, where every code is exact: each plane above the base
    # shifts the code left by its bits and adds them (zero where the slot no longer holds that width).
    # The bits a slot lacks read at their midpoint, (2**m - 1) / 2 steps, folded into its zero-point:
    # a (B, H_kv, n, groups) tensor rather than one per element.
    q = unpack(base, store.bits, dim).to(torch.float32)  # (B, H_kv, n, D)
    b, h, n = q.shape[:3]
    missing = torch.zeros(b, h, n, dtype=torch.float32, device=q.device)
    dense_pool = None
    for pool in reversed(store.pools):  # from the plane just above the base upwards
        if pool.dense:
            dense_pool = pool
            continue
        where = pool.where[:, :, start:end]  # (B, H_kv, n)
        have = where >= 0
        plane = unpack(pool.entries(which, where), pool.plane, dim)  # (B, H_kv, n, D) uint8
        q.mul_(2**pool.plane).add_(plane.mul_(have[..., None]))
        missing.add_((~have).to(torch.float32), alpha=pool.plane)
    groups = scale.shape[-1]
    scale = scale.float().unsqueeze(-1)  # (B, H_kv, n, groups, 1)
    zero = zero.float()
    if store.pools:
        zero = torch.addcmul(zero, (torch.exp2(missing) - 1).mul_(0.5)[..., None], scale[..., 0])
    q = q.reshape(b, h, n, groups, group)
    x = torch.addcmul(zero.unsqueeze(-1), q, scale).reshape(b, h, n, dim)
    if which == 0 and store.center is not None:
        x = x + store.center
    x = x.to(store.dtype)
    if dense_pool is not None:
        where = dense_pool.where[:, :, start:end]
        exact = dense_pool.entries(which, where)
        x = torch.where((where >= 0)[..., None], exact.to(x.dtype), x)
    return x
