"""Packed low-bit K/V: the quantiser's bound, byte counts, eviction on packed rows, tiled reads, the residual and
key centres (the cache with kv_bits: tests/hf/test_packed_cache.py; the tools: tests/tools/test_packed_tools.py)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.stores import ResidualStore, make_store
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.packed import PackedKVStore, dequantize, pack, quantize, unpack

BITS = [2, 4, 8]


def roundtrip(x, bits, group):
    packed, scale, zero = quantize(x, bits, group)
    return dequantize(packed, scale, zero, bits, group), scale


def per_element(scale, group):
    return scale.float().repeat_interleave(group, dim=-1)  # (..., D)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from(BITS), group=st.sampled_from([4, 8, 16, 32]), rows=st.integers(1, 4),
       values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=32, max_size=32),
       spread=st.floats(1e-6, 1e3), offset=st.floats(-1e3, 1e3))
def test_error_within_half_a_step(bits, group, rows, values, spread, offset):
    """|x - dequant(quant(x))| <= scale / 2 for every element, whatever the group's range or offset."""
    base = torch.tensor(values).reshape(1, 32) / 1e3 * spread + offset  # narrow or wide groups, far from 0 or not
    x = base.expand(rows, 32) * torch.linspace(1, 0.5, rows)[:, None]
    y, scale = roundtrip(x, bits, group)
    err = (x - y).abs()
    bound = per_element(scale, group) / 2
    # float32 arithmetic in quantising and dequantising: a few ulps of the values themselves
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + bound)
    assert bool((err <= bound + slack).all()), float((err - bound).max())
    # the scale is no coarser than the group's range needs (float16 rounding aside)
    lo = x.reshape(rows, -1, group).amin(-1)
    hi = x.reshape(rows, -1, group).amax(-1)
    need = ((hi - lo) / (2**bits - 1)).clamp(min=2.0**-14)
    assert bool((scale.float() <= need * (1 + 2.0**-8) + 2 * (lo.abs() + hi.abs()) * 2.0**-11 / (2**bits - 1)).all())


@pytest.mark.parametrize("bits", BITS)
def test_error_bound_on_gaussian_keys_and_it_shrinks_with_bits(bits):
    x = torch.randn(2, 3, 50, 64, generator=torch.Generator().manual_seed(bits)) * 4 + 1
    y, scale = roundtrip(x, bits, 32)
    err = (x - y).abs()
    assert bool((err <= per_element(scale, 32) / 2 + 1e-5).all())
    # a real quantiser, not the identity: the mean error is a sizeable part of the bound
    assert float(err.mean()) > 0.1 * float(per_element(scale, 32).mean() / 2)


@given(bits=st.sampled_from(BITS), dim=st.integers(1, 70), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_pack_unpack_roundtrip(bits, dim, seed):
    q = torch.randint(0, 2**bits, (3, dim), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(q, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-dim * bits // 8))
    assert torch.equal(unpack(packed, bits, dim), q)


def test_constant_group_reads_back_exactly():
    x = torch.full((1, 32), 3.25)
    for bits in BITS:
        y, _ = roundtrip(x, bits, 32)
        assert torch.equal(y, x)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [8, 32, 64])
def test_packed_sizes_are_the_expected_bytes(bits, group):
    b, h, cap, dk, dv = 3, 2, 40, 64, 32
    store = PackedKVStore(bits, group)
    store.allocate(torch.zeros(b, h, 1, dk), torch.zeros(b, h, 1, dv))
    store.resize(cap)
    gk, gv = min(group, dk), min(group, dv)
    data = b * h * cap * (dk + dv) * bits // 8
    scales = b * h * cap * (dk // gk + dv // gv) * 2 * 2  # scale and zero, float16 each
    assert store.data_bytes() == data
    assert store.scale_bytes() == scales
    assert store.nbytes() == data + scales
    assert store.bytes_per_token_head() * b * h * cap == data + scales


def filled_pair(bits, group=8, b=3, h=2, length=20, d=16, seed=0):
    """A dense and a packed store holding the same random K/V in ``length`` slots."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, length, d, generator=gen), torch.randn(b, h, length, d, generator=gen)
    dense, packed = DenseKVStore(), PackedKVStore(bits, group)
    for s in (dense, packed):
        s.allocate(k, v)
        s.resize(length)
        s.write(0, k, v)
    return dense, packed


def quantised(x, bits, group=8):
    return roundtrip(x, bits, group)[0]


@pytest.mark.parametrize("bits", BITS)
def test_reorder_and_batch_select_move_packed_rows(bits):
    """A packed store after reorder/select_batch holds exactly the quantised kept rows of the dense reference."""
    dense, packed = filled_pair(bits)
    order = torch.argsort(torch.rand(3, 2, 20, generator=torch.Generator().manual_seed(1)), dim=-1)  # (B, H_kv, 20)
    dense.reorder(order)
    packed.reorder(order)
    index = torch.tensor([2, 0, 0])
    dense.select_batch(index)
    packed.select_batch(index)
    for got, ref in zip(packed.read(15), dense.read(15)):
        assert torch.equal(got, quantised(ref, bits))


@pytest.mark.parametrize("bits", BITS)
def test_eviction_with_quantisation_equals_quantising_the_kept_rows(bits):
    """BudgetedKV: same appends (padding included) and same scores, dense vs packed store."""
    method = get_method("scissorhands")()
    layers = [BudgetedKV.checked(12, 2, 4, method, store=store) for store in (DenseKVStore(), PackedKVStore(bits, 8))]
    gen = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, 2, 10, 16, generator=gen), torch.randn(2, 2, 10, 16, generator=gen)
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[1, :3] = False  # left padding in row 1
    cum = valid.long().cumsum(1)
    scores = torch.rand(2, 2, 10, generator=gen)
    for kv in layers:
        kv.allocate(k, v)
        kv.append(k, v, valid, cum)
        kv.evict(scores, torch.tensor([4, 3]))
        kv.append(k[:, :, :3], v[:, :, :3], None, torch.arange(1, 4).expand(2, 3))
    dense, packed = layers
    assert torch.equal(dense.slots.positions, packed.slots.positions)
    length = dense.slots.length
    for got, ref in zip(packed.store.read(length), dense.store.read(length)):
        assert torch.equal(got, quantised(ref, bits))


@pytest.mark.parametrize("key_bits", BITS)
def test_keys_can_take_their_own_bit_width(key_bits):
    store = PackedKVStore(2, 16, key_bits=key_bits)
    store.allocate(torch.zeros(2, 3, 1, 32), torch.zeros(2, 3, 1, 32))
    store.resize(5)
    assert store.data_bytes() == 2 * 3 * 5 * (32 * key_bits // 8 + 32 * 2 // 8)
    k = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(key_bits))
    store.write(0, k, k)
    keys, values = store.read(5)
    assert torch.equal(keys, quantised(k, key_bits, 16)) and torch.equal(values, quantised(k, 2, 16))


def test_make_store_picks_dense_for_16_and_none():
    assert isinstance(make_store(CacheSettings()), DenseKVStore)
    assert isinstance(make_store(CacheSettings(kv_bits=16)), DenseKVStore)
    assert isinstance(make_store(CacheSettings(kv_bits=4)), PackedKVStore)
    wrapped = make_store(CacheSettings(kv_bits=4), residual=8)
    assert isinstance(wrapped, ResidualStore) and isinstance(wrapped.inner, PackedKVStore) and wrapped.residual == 8


@pytest.mark.parametrize("bad,message", [({"kv_bits": 3}, "kv_bits:"), ({"kv_bits": True}, "kv_bits:"),
                                         ({"kv_group_size": 0}, "kv_group_size:"),
                                         ({"kv_group_size": 24}, "kv_group_size:"),
                                         ({"kv_key_bits": 16, "kv_bits": 4}, "kv_key_bits:"),
                                         ({"kv_key_bits": 8}, "kv_key_bits:"),
                                         ({"kv_tile": 0}, "kv_tile:"), ({"kv_tile": 2.5}, "kv_tile:"),
                                         ({"kv_residual": -1, "kv_bits": 4}, "kv_residual:"),
                                         ({"kv_residual": 1.5, "kv_bits": 4}, "kv_residual:"),
                                         ({"kv_residual": 8}, "kv_residual:"),
                                         ({"kv_residual": 8, "kv_bits": 16}, "kv_residual:"),
                                         ({"kv_residual": 8, "kv_bits": 4, "merge": True}, "kv_residual:")])
def test_bad_settings_are_one_line_errors_naming_the_parameter(bad, message):
    with pytest.raises(ValueError) as e:
        CacheSettings(**bad)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# -- attention over a packed store, a tile at a time ------------------------------------------------

class ReadSpy:
    """A packed store that records the widest span of slots each read dequantised."""

    def __init__(self, store):
        self.store, self.widest = store, 0
        self.read_tile = store.read_tile

    def __getattr__(self, name):  # everything else goes to the store
        return getattr(self.store, name)

    def read(self, length):
        self.widest = max(self.widest, length)
        return self.store.read(length)

    def read_keys(self, start, end):
        self.widest = max(self.widest, end - start)
        return self.store.read_keys(start, end)

    def read_values(self, start, end):
        self.widest = max(self.widest, end - start)
        return self.store.read_values(start, end)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(1, 40), tile=st.integers(1, 48), n=st.integers(1, 3), seed=st.integers(0, 99),
       scaling=st.sampled_from([0.125, 0.3]), softcap=st.sampled_from([None, 5.0]), masked=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_tiled_attention_equals_reading_the_whole_layer(length, tile, n, seed, scaling, softcap, masked, dtype):
    """Key tiles into the logits, one softmax, value tiles summed: the same probabilities and output as one read
    of every slot, and no read wider than a tile."""
    from scissorhands.core.layer.kernel import attend_stored

    gen = torch.Generator().manual_seed(seed)
    b, h, g, d = 2, 2, 2, 16
    key, value = torch.randn(b, h, length, d, generator=gen) * 3, torch.randn(b, h, length, d, generator=gen)
    whole = PackedKVStore(4, 8, key_bits=8, read_tile=10**6)
    whole.allocate(key.to(dtype), value.to(dtype))
    whole.resize(length)
    whole.write(0, key.to(dtype), value.to(dtype))
    tiled = ReadSpy(PackedKVStore(4, 8, key_bits=8, read_tile=tile))
    tiled.store.allocate(key.to(dtype), value.to(dtype))
    tiled.store.resize(length)
    tiled.store.write(0, key.to(dtype), value.to(dtype))
    q = (torch.randn(b, h, g * n, d, generator=gen)).to(dtype)
    lo = max(0, length - n)
    allowed = None
    if masked:  # causal over the last n slots, as a block of n queries sees them
        slot = torch.arange(lo, length)
        allowed = (slot[None, :] <= (lo + torch.arange(n))[:, None])[None, None, None].expand(b, 1, 1, n, -1)
    weight = torch.tensor([1.0, 0.0])[:, None, None, None, None]  # the second row is padding
    kw = dict(softcap=softcap, allowed=allowed, shape=(b, h, g, n, length), mask_from=lo, query_weight=weight)
    p1, o1 = attend_stored(q, whole, length, scaling, **kw)
    p2, o2 = attend_stored(q, tiled, length, scaling, **kw)
    assert tiled.widest <= tile
    assert o1.dtype == o2.dtype == dtype and p2.shape == (b, h, g, n, length)
    torch.testing.assert_close(p2, p1, rtol=0, atol=1e-6)
    atol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the untiled product rounds once, the tiles each
    torch.testing.assert_close(o2.float(), o1.float(), rtol=0, atol=atol)
    assert bool((o2[1] == 0).all())


# -- per-channel key centres (calibrate) ------------------------------------------------------------

def _packed(key, value, **kw):
    store = PackedKVStore(4, 8, **kw)
    store.allocate(key, value)
    store.resize(key.shape[2])
    store.write(0, key, value)
    return store


def test_key_centres_of_zero_change_nothing_and_centring_shrinks_offset_channels():
    gen = torch.Generator().manual_seed(3)
    offset = torch.zeros(2, 16)
    offset[:, ::4] = 40.0  # a few channels with a large, nearly constant value, as RoPE's slow pairs carry
    key = torch.randn(1, 2, 30, 16, generator=gen) + offset[None, :, None]
    value = torch.randn(1, 2, 30, 16, generator=gen)
    plain = _packed(key, value)
    zero = _packed(key, value, key_center=torch.zeros(2, 16))
    assert torch.equal(plain.read(30)[0], zero.read(30)[0]) and torch.equal(plain.read(30)[1], zero.read(30)[1])
    centred = _packed(key, value, key_center=offset)
    k_plain, k_centred = plain.read(30)[0], centred.read(30)[0]
    # each element within half a step of its centred group, and the steps are far finer
    step = per_element(centred.k.scale, 8).view(1, 2, 30, 16)
    assert bool(((key - k_centred).abs() <= step / 2 + 1e-4).all())
    assert float((key - k_centred).abs().mean()) < 0.2 * float((key - k_plain).abs().mean())
    assert torch.equal(centred.read(30)[1], plain.read(30)[1])  # values are not centred
    assert centred.scale_bytes() == plain.scale_bytes() + 2 * 16 * 4  # the centres are counted, once per layer


def _rotated(x, positions, inv_freq):
    """Naive RoPE: each pair (i, i + D/2) of ``x`` (..., D) turned by positions (...) * inv_freq[i]."""
    half = x.shape[-1] // 2
    angle = positions[..., None].double() * inv_freq.double()
    c, s_ = angle.cos(), angle.sin()
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * c - b * s_, b * c + a * s_], dim=-1)


def test_rotary_centres_follow_a_rotating_offset_through_scattered_writes_and_eviction():
    """Keys = RoPE(p) of (a large per-channel offset + noise), as a biased key projection gives. The store, given
    each token's position, reads every key back as the naive per-token quantisation around the offset rotated to
    that position, wherever the token was written and however the slots were reordered since."""
    from scissorhands.core.stores.centers import RotaryCenters

    gen = torch.Generator().manual_seed(5)
    h, d = 2, 16
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, d, 2).float() / d))
    mean = torch.randn(h, d, generator=gen) * 30
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12]])  # (B, 8): rows at other positions

    def keys_at(p):  # (B, H, T, D) float32 keys before RoPE = mean + noise, rotated to p (B, T)
        noise = torch.randn(*p.shape[:1], h, p.shape[1], d, generator=gen)
        return _rotated(mean[None, :, None] + noise, p[:, None, :], inv_freq).float()

    key, value = keys_at(pos), torch.randn(2, h, 8, d, generator=gen)
    stores = {}
    for name, center in (("rotary", RotaryCenters(mean, inv_freq)), ("fixed", mean), ("plain", None)):
        store = PackedKVStore(4, 8, key_center=center)
        assert store.wants_positions == (name == "rotary")
        store.allocate(key, value)
        store.resize(12)
        store.write(0, key, value, positions=pos)
        stores[name] = store
    # two scattered tokens (row 0 slot 8 at position 20, row 1 slot 8 at position 3), then a reorder per head
    rows, slots, where = torch.tensor([0, 1]), torch.tensor([8, 8]), torch.tensor([20, 3])
    extra = keys_at(where[:, None])[:, :, 0]  # (N, H, D)
    extra_v = torch.randn(2, h, d, generator=gen)
    order = torch.stack([torch.randperm(9, generator=gen) for _ in range(2 * h)]).view(2, h, 9)
    for name, store in stores.items():
        store.write_at(rows, slots, extra, extra_v, positions=where if name == "rotary" else None)
        store.reorder(order)
    all_keys = torch.cat([key, extra[:, :, None]], dim=2)  # (B, H, 9, D) in written order
    all_pos = torch.cat([pos, where[:, None]], dim=1)  # (B, 9)
    kept = all_keys.gather(2, order[..., None].expand(-1, -1, -1, d))
    kept_pos = all_pos[:, None, :].expand(-1, h, -1).gather(2, order)  # (B, H, 9)
    center = _rotated(mean[None, :, None].expand(2, h, 9, d), kept_pos, inv_freq).float()
    naive = roundtrip(kept - center, 4, 8)[0] + center
    read = stores["rotary"].read(9)[0]
    torch.testing.assert_close(read, naive, rtol=0, atol=1e-4)  # float32 RoPE tables against float64 ones
    err = {name: float((s.read(9)[0] - kept).abs().mean()) for name, s in stores.items()}
    assert err["rotary"] < 0.1 * err["fixed"] and err["rotary"] < 0.1 * err["plain"], err
    plain = stores["plain"]
    assert stores["rotary"].bytes_per_token_head() == plain.bytes_per_token_head() + 4  # each slot's position
    with pytest.raises(RuntimeError, match="position"):
        stores["rotary"].write(0, key, value)


# -- the full-precision residual of the newest tokens ---------------------------------------------

def _exact_reference(q, packed_k, packed_v, exact_k, exact_v, limits, r, scaling):
    """Naive: each query (row b, column j) attends to its first limits[b, j] slots, the last r of them exact."""
    b, h, m, _ = q.shape
    n = limits.shape[1]
    g = m // n
    out = torch.zeros(b, h, m, exact_v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for j in range(n):
            lim = int(limits[bi, j])
            cut = max(0, lim - r)
            keys = torch.cat([packed_k[bi, :, :cut], exact_k[bi, :, cut:lim]], dim=1).double()  # (H, lim, D)
            vals = torch.cat([packed_v[bi, :, :cut], exact_v[bi, :, cut:lim]], dim=1).double()
            for gi in range(g):
                row = gi * n + j
                p = torch.softmax(q[bi, :, row].double()[:, None, :] @ keys.transpose(1, 2) * scaling, dim=-1)
                out[bi, :, row] = (p @ vals)[:, 0]
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(st.integers(0, 20), min_size=1, max_size=3), new=st.integers(1, 6), r=st.integers(1, 9),
       tile=st.integers(1, 12), seed=st.integers(0, 99))
def test_residual_attention_equals_the_naive_per_query_choice(first, new, r, tile, seed):
    """Rows of different lengths get a block of new tokens; every query of the block reads its own last r slots
    exact and the older ones packed, as a naive per-query loop does."""
    from scissorhands.core.layer.kernel import attend_stored

    gen = torch.Generator().manual_seed(seed)
    b, h, g, d = len(first), 2, 2, 16
    lengths = [f + new for f in first]
    top = max(lengths)
    key, value = torch.randn(b, h, top, d, generator=gen) * 3, torch.randn(b, h, top, d, generator=gen)
    store = ResidualStore(PackedKVStore(4, 8, read_tile=tile), r)
    store.allocate(key, value)
    store.resize(top)
    for lo, hi in ((0, first), (first, lengths)):  # the old tokens, then the block, each row's tokens in order
        lo = [0] * b if lo == 0 else lo
        rows = torch.tensor([bi for bi in range(b) for _ in range(lo[bi], hi[bi])], dtype=torch.long)
        slots = torch.tensor([s for bi in range(b) for s in range(lo[bi], hi[bi])], dtype=torch.long)
        if rows.numel():
            store.write_at(rows, slots, key[rows, :, slots], value[rows, :, slots])
    assert store.residual_bytes() == store.tail.keys.nbytes * 2 and store.tail.width >= new
    limits = torch.tensor([[f + 1 + j for j in range(new)] for f in first])  # (B, n): the block's queries
    q = torch.randn(b, h, g * new, d, generator=gen)
    length = int(limits.max())
    lo = int(limits.min())
    slot = torch.arange(lo, length)
    allowed = (slot[None, None, :] < limits[:, :, None])[:, None, None]  # (B, 1, 1, n, L - lo)
    probs, out = attend_stored(q, store, length, 0.3, allowed=allowed, shape=(b, h, g, new, length), mask_from=lo,
                               limits=limits, ends=torch.tensor(lengths))
    pk, pv = store.read(top)
    ref = _exact_reference(q, pk, pv, key, value, limits, r, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(st.lists(st.integers(0, 4), min_size=2, max_size=2), st.booleans()),
                      min_size=1, max_size=8), r=st.integers(1, 4), seed=st.integers(0, 99))
def test_residual_holds_each_rows_newest_tokens_through_evictions(steps, r, seed):
    """Ragged appends and evictions that keep the recent window: the tail always reads back, exact, the last r
    stored tokens of every row, and it holds exactly r per row once settled."""
    from scissorhands.core.tokens.selection import keep_order

    gen = torch.Generator().manual_seed(seed)
    b, h, d, recent = 2, 2, 8, 4
    store = ResidualStore(PackedKVStore(4, 8), r)
    store.allocate(torch.zeros(b, h, 1, d), torch.zeros(b, h, 1, d))
    store.resize(64)
    held_k = [torch.empty(h, 0, d) for _ in range(b)]  # what each row stores, in slot order, exact
    for counts, evict in steps:
        rows = torch.tensor([bi for bi in range(b) for _ in range(counts[bi])], dtype=torch.long)
        slots = torch.tensor([held_k[bi].shape[1] + i for bi in range(b) for i in range(counts[bi])],
                             dtype=torch.long)
        k = torch.randn(len(rows), h, d, generator=gen)
        if rows.numel():
            store.write_at(rows, slots, k, k + 1)
        for bi in range(b):
            held_k[bi] = torch.cat([held_k[bi], k[rows == bi].transpose(0, 1)], dim=1)
        lengths = torch.tensor([x.shape[1] for x in held_k])
        if evict and bool((lengths > recent).all()):
            n_drop = torch.ones(b, dtype=torch.long)
            keep = keep_order(torch.randn(b, h, int(lengths.max()), generator=gen), lengths, recent, n_drop)
            store.reorder(keep)
            for bi in range(b):
                kept = keep[bi, :, : int(lengths[bi]) - 1]  # (H, L_b - 1)
                held_k[bi] = held_k[bi].gather(1, kept[:, :, None].expand(-1, -1, d))
        store.settle()
        lengths = torch.tensor([x.shape[1] for x in held_k])
        assert min(r, int(lengths.max())) <= store.tail.width <= r
        for bi in range(b):
            n = min(r, int(lengths[bi]))
            if n:
                got = store.read_exact_keys(int(lengths[bi]) - n, int(lengths[bi]), lengths)[bi]
                assert torch.equal(got, held_k[bi][:, -n:])
                assert torch.equal(store.read_exact_values(int(lengths[bi]) - n, int(lengths[bi]), lengths)[bi],
                                   held_k[bi][:, -n:] + 1)


def test_a_layer_refuses_a_residual_its_recent_window_or_merging_cannot_keep():
    from scissorhands.core.methods.scissorhands import Scissorhands

    with pytest.raises(ValueError, match="^kv_residual: "):
        BudgetedKV.checked(16, 2, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3))
    with pytest.raises(ValueError, match="^kv_residual: "):
        BudgetedKV.checked(16, 4, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3), merge=True)
    BudgetedKV.checked(16, 3, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3))
