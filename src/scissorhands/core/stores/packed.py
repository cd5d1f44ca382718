"""Packed low-bit K/V storage: asymmetric group-wise quantisation behind the store interface.

Each stored token's key and value vectors are cut into groups of
``group_size`` consecutive channels along the head dimension (the whole head
if it is smaller). A group keeps a scale ``s`` and a zero-point ``z`` in
float16 and one integer ``q`` in ``[0, 2**bits - 1]`` per element, packed
``8 // bits`` to a byte; ``x`` is read back as ``q * s + z``.

The zero-point is the group's minimum rounded down to float16 and the scale
covers the group's maximum from there, rounded up, so no element is clipped
and each is read back within ``s / 2`` of its value (:func:`quantize`).

Groups lie within one token, so a token is quantised once, when it is
written, and never again: no other token changes its groups. That is what lets
an eviction move a token's packed bytes with its scales and zero-points as one
row (:meth:`PackedKVStore.reorder`), and what keeps blocked prefill equal to
token-by-token decoding. KIVI's per-channel keys (groups along tokens) were
measured against this layout; see docs/quantization.md.
"""

from __future__ import annotations

import torch

from ..settings.storage import PackedSettings
from .base import KVStore, gather_rows
from .centers import RotaryCenters, centers_frame

BITS = (2, 4, 8)
_MIN_SCALE = 2.0**-14  # the smallest normal float16: a constant group still gets a usable scale


def _check_bits(bits) -> None:
    if bits not in BITS:
        raise ValueError(f"kv_bits: must be one of {BITS} for a packed store, got {bits!r}")


def packed_width(dim: int, bits: int) -> int:
    """Bytes that ``dim`` integers of ``bits`` bits take, packed (the last byte may be part-filled)."""
    return -(-dim * bits // 8)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers ``q`` (..., D) in ``[0, 2**bits)`` into bytes (..., ceil(D * bits / 8)), lowest bits first."""
    per = 8 // bits
    if per == 1:
        return q.to(torch.uint8)
    d = q.shape[-1]
    q = q.to(torch.uint8)
    if d % per:
        q = torch.nn.functional.pad(q, (0, packed_width(d, bits) * per - d))  # (..., whole bytes)
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)  # (..., bytes, per)
    out = q[..., 0] | (q[..., 1] << bits)
    for i in range(2, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int, dim: int | None = None) -> torch.Tensor:
    """The ``dim`` integers (..., dim) packed in ``packed`` (..., bytes), as uint8 (default: every slot)."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = 2**bits - 1
    # One masked shift per position in the byte, stacked: faster than broadcasting a shift tensor (or a
    # lookup table). The lowest position needs no shift and the highest no mask.
    parts = [packed & mask] + [(packed >> (bits * i)) & mask for i in range(1, per - 1)]
    q = torch.stack(parts + [packed >> (bits * (per - 1))], dim=-1)  # (..., bytes, per)
    q = q.reshape(*packed.shape[:-1], packed.shape[-1] * per)  # (..., bytes * per)
    return q if dim is None else q[..., :dim]


def quantize_codes(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize` before packing: integer codes (..., D) as uint8, and the scale and zero (..., D // group)."""
    *lead, d = x.shape
    xg = x.float().reshape(*lead, d // group, group)  # (..., G, group)
    lo, hi = torch.aminmax(xg, dim=-1)  # (..., G)
    zero = lo.half()
    # Round the zero-point down so that no element lies below it.
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    zf = zero.float()
    levels = 2**bits - 1
    # Inflate by more than float16's rounding error: the rounded scale still reaches the maximum, nothing is clipped.
    scale = ((hi - zf) / levels).clamp_(min=_MIN_SCALE).mul_(1 + 2.0**-10).half()
    q = (xg - zf.unsqueeze(-1)).div_(scale.float().unsqueeze(-1)).round_().clamp_(0, levels)
    return q.reshape(*lead, d).to(torch.uint8), scale, zero


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (..., D) in groups of ``group`` along the last axis.

    Returns
    -------
    packed : uint8 Tensor, shape (..., ceil(D * bits / 8))
    scale, zero : float16 Tensors, shape (..., D // group)
        ``dequantize`` gives back each element within ``scale / 2`` of ``x``
        (for values inside float16's range).
    """
    q, scale, zero = quantize_codes(x, bits, group)
    return pack(q, bits), scale, zero


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale + zero`` (..., D) for packed integers (..., bytes) in groups of ``group``; G = scale.shape[-1]."""
    groups = scale.shape[-1]
    q = unpack(packed, bits, groups * group)  # (..., D)
    *lead, d = q.shape
    q = q.reshape(*lead, groups, group).to(torch.float32)  # (..., G, group)
    x = torch.addcmul(zero.float().unsqueeze(-1), q, scale.float().unsqueeze(-1))  # q * scale + zero, float32
    return x.reshape(*lead, d).to(dtype)  # (..., D)


def group_for(dim: int, group_size: int) -> int:
    """The largest divisor of ``dim`` not above ``group_size``: the group a packed store cuts a head into."""
    return next(g for g in range(min(group_size, dim), 0, -1) if dim % g == 0)


def centred(x: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor:
    """``x`` (a block (B, H_kv, c, D) or tokens (N, H_kv, D)) less its per-channel centres (H_kv, 1, D), if any."""
    if center is None:
        return x
    return x.float() - (center if x.dim() == 4 else center[:, 0])


def check_key_center(center: torch.Tensor | RotaryCenters | None, heads: int, dim: int) -> None:
    """A one-line ``ValueError`` naming ``kv_key_centers`` unless ``center`` is None or (heads, dim)."""
    if center is not None and tuple(center.shape) != (heads, dim):
        raise ValueError(f"kv_key_centers: centres of shape {tuple(center.shape)} do not fit {heads} KV heads of "
                         f"{dim} channels")


def packed_bytes_per_token_head(dim_k: int, dim_v: int, bits: int, key_bits: int | None, group_size: int) -> int:
    """Bytes one token costs per KV head in a packed store: K and V data, and an fp16 scale and zero per group."""
    total = 0
    for dim, b in ((dim_k, bits if key_bits is None else key_bits), (dim_v, bits)):
        total += packed_width(dim, b) + (dim // group_for(dim, group_size)) * 2 * 2
    return total


class PackedTensor:
    """One of K or V, packed: data (B, H_kv, capacity, ceil(D * bits / 8)), scale and zero (B, H_kv, capacity, G).

    Every slot's bytes, scales and zero-points sit on the same slot axis, so one
    index moves a token's whole packed row. With rotary centres each slot's
    position (B, H_kv, capacity, 1) int32 is part of its row too.
    """

    def __init__(self, bits: int, group: int, batch: int, heads: int, dim: int, device,
                 center: torch.Tensor | RotaryCenters | None = None):
        self.bits, self.group, self.dim = bits, group, dim
        self.data = torch.zeros(batch, heads, 0, packed_width(dim, bits), dtype=torch.uint8, device=device)
        self.scale = torch.zeros(batch, heads, 0, dim // group, dtype=torch.float16, device=device)
        self.zero = torch.zeros_like(self.scale)
        self.rotary = center.to(device) if isinstance(center, RotaryCenters) else None
        self.pos = torch.zeros(batch, heads, 0, 1, dtype=torch.int32, device=device) if self.rotary else None
        # A per-(head, channel) offset taken off before quantising and added back when reading (H_kv, 1, D).
        fixed = center if isinstance(center, torch.Tensor) else None
        self.center = None if fixed is None else fixed.to(device=device, dtype=torch.float32)[:, None, :]

    def quantized(self, x: torch.Tensor, positions: torch.Tensor | None = None):
        """(data, scale, zero) of a block (B, H_kv, c, D) or of tokens (N, H_kv, D), around the centres if any.

        ``positions`` ((B, c) or (N,)): the tokens' positions, which rotary centres need.
        """
        if self.rotary is None:
            return quantize(centred(x, self.center), self.bits, self.group)
        if positions is None:
            raise RuntimeError("PackedTensor: rotary key centres need each written token's position")
        if x.dim() == 4:
            center = self.rotary.at(positions[:, None, :])  # (B, H_kv, c, D)
        else:
            center = self.rotary.at(positions[:, None, None])[:, :, 0]  # (N, H_kv, D)
        return quantize(x.float() - center, self.bits, self.group)

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        return (self.data, self.scale, self.zero) if self.pos is None else (self.data, self.scale, self.zero, self.pos)

    def _set(self, parts) -> None:
        if self.pos is None:
            self.data, self.scale, self.zero = parts
        else:
            self.data, self.scale, self.zero, self.pos = parts

    def with_positions(self, parts, positions: torch.Tensor | None, block: bool) -> tuple:
        """``parts`` with the tokens' positions as the row's last part, when this tensor keeps them."""
        if self.pos is None:
            return tuple(parts)
        assert positions is not None
        pos = positions.to(torch.int32)
        pos = pos[:, None, :, None] if block else pos[:, None, None]  # (B, 1, c, 1) or (N, 1, 1)
        like = parts[1]  # the scales: (B, H_kv, c, G) or (N, H_kv, G)
        return (*parts, pos.expand(*like.shape[:-1], 1))

    def resize(self, capacity: int) -> None:
        def resized(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])  # (B, H_kv, capacity, ·)
            keep = min(capacity, t.shape[-2])
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self._set(tuple(resized(t) for t in self.parts))

    def put(self, start: int, parts) -> None:
        """Store already quantised (data, scale, zero) of a block at slots ``[start, start + c)``."""
        c = parts[0].shape[-2]
        for t, new in zip(self.parts, parts):
            t[:, :, start : start + c] = new

    def put_at(self, rows: torch.Tensor, slots: torch.Tensor, parts) -> None:
        """Store already quantised parts of token ``i`` (data[i]: (H_kv, ·)) at slot ``slots[i]`` of ``rows[i]``."""
        for t, new in zip(self.parts, parts):
            t[rows, :, slots] = new

    def pairs_with(self, other: PackedTensor) -> bool:
        """Whether ``other`` is quantised alike (bits, group, width, no centre): then both quantise in one call."""
        return (self.bits, self.group, self.dim) == (other.bits, other.group, other.dim) and \
            self.center is None and other.center is None and self.rotary is None and other.rotary is None

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        for t in self.parts:
            gather_rows(t, order, rows)

    def select_batch(self, index: torch.Tensor) -> None:
        self._set(tuple(t.index_select(0, index) for t in self.parts))

    def read(self, length: int, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
        """Slots ``[start, length)``, dequantised: (B, H_kv, length - start, D)."""
        plain = self.center is None and self.rotary is None
        x = dequantize(self.data[:, :, start:length], self.scale[:, :, start:length],
                       self.zero[:, :, start:length], self.bits, self.group, dtype if plain else torch.float32)
        if plain:
            return x
        if self.rotary is not None:
            assert self.pos is not None
            return (x + self.rotary.at(self.pos[:, :, start:length, 0])).to(dtype)
        assert self.center is not None
        return (x + self.center).to(dtype)

    def data_bytes(self) -> int:
        return self.data.nbytes

    def scale_bytes(self) -> int:
        """Scales and zero-points, and the per-channel centres (and each slot's position) when there are any."""
        own = self.scale.nbytes + self.zero.nbytes + (0 if self.center is None else self.center.nbytes)
        return own if self.rotary is None or self.pos is None else own + self.rotary.nbytes + self.pos.nbytes

    def bytes_per_token_head(self) -> int:
        return sum(t.shape[-1] * t.element_size() for t in self.parts)


class PackedKVStore(KVStore):
    """K and V quantised to ``bits`` (2, 4 or 8) per element, in groups of ``group_size`` channels.

    Parameters
    ----------
    bits : {2, 4, 8}
        Bits per value element, and per key element unless ``key_bits`` is given.
    key_bits : {2, 4, 8}, optional
        Bits per key element. Keys suffer more than values from per-token
        groups (their channels differ in scale), so 8-bit keys with 4-bit
        values is a measured sweet spot (docs/quantization.md).
    group_size : int
        Channels per group along the head dimension; a head smaller than this
        is one group, and a head it does not divide takes the largest divisor
        below it.
    read_tile : int
        Most slots attention dequantises at once (:func:`.kernel.attend_stored`):
        the transient dense copy is one tile of K or V, never the whole layer.
    key_center : Tensor or RotaryCenters, optional
        (H_kv, D): each key channel's offset, taken off before quantising and
        added back when reading; or centres before RoPE, rotated to each
        token's position, for which the store keeps every slot's position
        (see :mod:`scissorhands.core.stores.centers`).

    A full-precision residual of the newest tokens is a wrapper over this
    store (:class:`~.residual.ResidualStore`), as over any other.
    """

    name = "packed"
    Settings = PackedSettings  # kv_key_bits, kv_group_size, kv_tile: valid only with this store (and tiered)

    def __init__(self, bits: int = 4, group_size: int = 32, key_bits: int | None = None, read_tile: int = 512,
                 key_center: torch.Tensor | RotaryCenters | None = None):
        _check_bits(bits)
        if key_bits is not None and key_bits not in BITS:
            raise ValueError(f"kv_key_bits: must be one of {BITS} or None, got {key_bits!r}")
        if isinstance(read_tile, bool) or not isinstance(read_tile, int) or read_tile < 1:
            raise ValueError(f"kv_tile: must be an integer >= 1, got {read_tile!r}")
        self.bits, self.group_size, self.read_tile = bits, group_size, read_tile
        self.key_center = key_center
        self.wants_positions = isinstance(key_center, RotaryCenters)
        self.key_bits = bits if key_bits is None else key_bits
        self.reset()

    def reset(self) -> None:
        self.k: PackedTensor | None = None
        self.v: PackedTensor | None = None
        self.paired = False
        self.dtype = torch.float32

    def _group(self, dim: int) -> int:
        """The largest divisor of ``dim`` not above ``group_size`` (``group_size`` itself for power-of-two heads)."""
        return group_for(dim, self.group_size)

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        b, h, _, dk = key.shape
        dv = value.shape[-1]
        check_key_center(self.key_center, h, dk)
        self.k = PackedTensor(self.key_bits, self._group(dk), b, h, dk, key.device, self.key_center)
        self.v = PackedTensor(self.bits, self._group(dv), b, h, dv, value.device)
        self.dtype = key.dtype
        # K and V quantised alike (bits, group, width, no centre): one call on both halves the fixed cost of
        # writing a token, which a decode step pays in every layer.
        self.paired = self.k.pairs_with(self.v) and key.dtype == value.dtype

    def _parts(self) -> tuple[PackedTensor, PackedTensor]:
        if self.k is None or self.v is None:
            raise RuntimeError("PackedKVStore: used before allocate")
        return self.k, self.v

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.data.shape[-2]

    def resize(self, capacity: int) -> None:
        for p in self._parts():
            p.resize(capacity)

    def _quantized(self, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None):
        """The packed parts of new K and of new V, each token quantised once."""
        k, v = self._parts()
        if self.paired:
            packed = quantize(torch.stack([key, value]), k.bits, k.group)
            return [t[0] for t in packed], [t[1] for t in packed]
        block = key.dim() == 4
        return k.with_positions(k.quantized(key, positions), positions, block), v.quantized(value)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        k_parts, v_parts = self._quantized(key, value, positions)
        for p, parts in zip(self._parts(), (k_parts, v_parts)):
            p.put(start, parts)

    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        k_parts, v_parts = self._quantized(key, value, positions)
        for p, parts in zip(self._parts(), (k_parts, v_parts)):
            p.put_at(rows, slots, parts)

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        for p in self._parts():
            p.reorder(order, rows)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._parts()
        return k.read(length, self.dtype), v.read(length, self.dtype)

    def read_keys(self, start: int, end: int) -> torch.Tensor:
        return self._parts()[0].read(end, self.dtype, start)

    def read_values(self, start: int, end: int) -> torch.Tensor:
        return self._parts()[1].read(end, self.dtype, start)

    def select_batch(self, index: torch.Tensor) -> None:
        for p in self._parts():
            p.select_batch(index)

    def nbytes(self) -> int:
        return self.data_bytes() + self.scale_bytes()

    def data_bytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.data_bytes() + self.v.data_bytes()

    def scale_bytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.scale_bytes() + self.v.scale_bytes()

    def bytes_per_token_head(self) -> int:
        k, v = self._parts()
        return k.bytes_per_token_head() + v.bytes_per_token_head()

    @classmethod
    def from_settings(cls, settings, key_center: torch.Tensor | RotaryCenters | None = None) -> PackedKVStore:
        return cls(settings.kv_bits, settings.kv_group_size, settings.kv_key_bits, settings.kv_tile, key_center)

    @classmethod
    def bytes_for(cls, settings, shape, tokens: int) -> int:
        per = packed_bytes_per_token_head(shape.head_dim_k, shape.head_dim_v, int(settings.kv_bits or 16),
                                          settings.kv_key_bits, settings.kv_group_size)
        if settings.kv_key_centers is not None and centers_frame(settings.kv_key_centers) == "rotary":
            per += 4  # each slot's position, which rotary centres are read back with
        return tokens * per
