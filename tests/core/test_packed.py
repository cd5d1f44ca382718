"""Packed low-bit K/V: the quantiser's bound, byte counts, eviction on packed rows, and the cache with kv_bits."""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scoring import BASE, decode_logprobs

from conftest import batch_and_alone, left_padded, run_cli, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.methods import get_method
from scissorhands.core.stores import ResidualStore, make_store
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.packed import PackedKVStore, dequantize, pack, quantize, unpack
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs, token_logprobs

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
    layers = [BudgetedKV(12, 2, 4, method, store=store) for store in (DenseKVStore(), PackedKVStore(bits, 8))]
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


def test_group_is_the_largest_divisor_of_the_head_not_above_the_setting():
    model = tiny_model("llama")  # head_dim 16
    store = PackedKVStore(2, 16)
    store.allocate(torch.zeros(1, 2, 1, 24), torch.zeros(1, 2, 1, 10))
    assert (store.k.group, store.v.group) == (12, 10)
    store.resize(3)
    assert store.data_bytes() == 2 * 3 * (6 + 3) and store.scale_bytes() == 2 * 3 * (2 + 1) * 4
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=8, recent=2, kv_bits=4, kv_group_size=64))
    ids, mask = left_padded([12], seed=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)  # a head smaller than the group is one group
    assert cache.budgeted_layers[0].kv.store.inner.k.group == 16  # the default residual wraps the packed store


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


def test_decoding_dequantises_no_more_than_a_tile():
    """Through the model: every attention read of a packed layer spans at most kv_tile slots."""
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24, recent=4, kv_bits=4, kv_tile=7))
    spies = [ReadSpy(layer.kv.store) for layer in cache.budgeted_layers]
    for layer, spy in zip(cache.budgeted_layers, spies):
        layer.kv.store = spy
    ids, mask = left_padded([20, 14], seed=2)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=12, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == 20 + 12
    assert all(0 < spy.widest <= 7 for spy in spies)


# -- the cache and the exact scorer with kv_bits --------------------------------------------------

@pytest.mark.parametrize("bits,key_bits,tile", [(2, None, 512), (4, None, 512), (8, None, 512), (4, 8, 512),
                                                (4, None, 5), (4, 8, 1)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_scorer_equals_decoding_with_quantisation(bits, key_bits, tile, arch):
    """One blocked forward = token-by-token decoding through the packed cache (GQA and sliding layers too),
    whether attention reads the stored slots at once or a few at a time."""
    model = tiny_model(arch)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=bits, kv_key_bits=key_bits, kv_group_size=8, kv_tile=tile, kv_residual=0)
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert isinstance(cache.budgeted_layers[0].kv.store, PackedKVStore)
    assert cache.memory_report()["peak_stored"] <= 16
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)
    plain, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, BASE))
    assert not torch.equal(fast, plain)  # the packed store is really in the path


@pytest.mark.parametrize("bits", [None, 16])
def test_kv_bits_16_or_none_is_the_unquantised_cache(bits):
    model = tiny_model("gemma3")
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(4))
    base = replace(BASE, kv_bits=bits)
    for name, budget in (("scissorhands", 16), ("full", None)):
        got, _ = token_logprobs(model, ids, ScoreSetup(get_method(name), budget, base))
        ref, _ = token_logprobs(model, ids, ScoreSetup(get_method(name), budget, BASE))
        assert torch.equal(got, ref)
    ids2, mask = left_padded([30, 12], seed=3)
    outs = []
    for cfg in (ScissorhandsConfig(budget=12, recent=3, kv_bits=bits), ScissorhandsConfig(budget=12, recent=3)):
        with torch.no_grad():
            outs.append(model.generate(ids2, attention_mask=mask, cache=ScissorhandsCache(model, cfg),
                                       max_new_tokens=10, do_sample=False, pad_token_id=0))
    assert torch.equal(*outs)


def test_quantised_full_cache_evicts_nothing_and_holds_packed_bytes():
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head_dim 16
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(5))
    setup = ScoreSetup(get_method("full"), None, CacheSettings(kv_bits=4, kv_group_size=8, kv_residual=0))
    cache = setup.make_cache(model, 40)
    assert isinstance(cache, ScissorhandsCache)
    lp, _ = token_logprobs(model, ids, setup, cache=cache)
    plain, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, CacheSettings()))
    assert not torch.equal(lp, plain) and float((lp - plain).abs().mean()) < 0.1
    assert all(layer.compressions == 0 for layer in cache.budgeted_layers)
    report = cache.memory_report()
    tokens_heads = 40 * 2 * 2  # tokens x KV heads x layers
    assert report["kv_data_bytes"] == tokens_heads * (16 + 16) * 4 // 8
    assert report["kv_scale_bytes"] == tokens_heads * (2 + 2) * 4
    assert report["kv_residual_bytes"] == 0
    assert report["budgeted_kv_bytes"] == report["kv_data_bytes"] + report["kv_scale_bytes"]
    assert report["bf16_full_kv_bytes"] == tokens_heads * 32 * 2
    assert report["full_kv_bytes"] == tokens_heads * 32 * 4  # the model's dtype: float32
    assert report["kv_reduction_vs_bf16"] == pytest.approx(64 / 32)  # 64 bf16 bytes vs 16 data + 16 scale bytes


def test_memory_report_counts_packed_bytes_under_eviction():
    model = tiny_model("llama")
    ids, mask = left_padded([50], seed=9)
    cfg = ScissorhandsConfig(budget=32, recent=4, window=400, window_buckets=8, kv_bits=2, kv_group_size=16,
                             kv_residual=0)
    cache = ScissorhandsCache(model, cfg)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    report = cache.memory_report()
    stores = [layer.kv.store for layer in cache.budgeted_layers]
    assert report["budgeted_kv_bytes"] == sum(t.nbytes for s in stores for p in (s.k, s.v) for t in p.parts)
    m = report["layers"][0]
    assert m["kv_bytes_per_token_head"] == 2 * (16 * 2 // 8 + 4)  # K and V: packed data + one group's scale/zero
    assert m["capacity"] <= 32
    held = report["budgeted_kv_bytes"] + report["importance_bytes"] + report["position_bytes"]
    assert report["total_reduction_vs_bf16"] == pytest.approx(report["bf16_full_kv_bytes"] / held)
    assert report["bf16_full_kv_bytes"] == 59 * 2 * 2 * 32 * 2  # 59 tokens seen, 2 heads, 2 layers, K+V, bf16


@pytest.mark.parametrize("name", ["full", "scissorhands"])
def test_batch_with_padding_equals_each_sequence_alone_quantised(name):
    """Continuations scored as one padded batch equal each sequence alone (gemma3: sliding layers, padding)."""
    model = tiny_model("gemma3")
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(3, 256, (40,), generator=gen).tolist()
    conts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 5, 3)]
    base = replace(BASE, kv_bits=4, kv_group_size=8)
    setup = ScoreSetup(get_method(name), 20, base)
    got = continuation_logprobs(model, context, conts, setup)
    for (lp, _), c in zip(got, conts):
        ids = torch.tensor(context + c)
        alone, _ = token_logprobs(model, ids, setup)
        assert lp == pytest.approx(float(alone[-len(c):].sum()), abs=1e-4)


def test_batched_generation_equals_each_sequence_alone_quantised():
    model = tiny_model("llama", torch.float64)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4, window=8, window_buckets=4, kv_bits=4, kv_group_size=8)
    batch_and_alone(model, cfg, [30, 21, 9])


def test_batched_generation_equals_each_sequence_alone_with_rotary_key_centres(tmp_path):
    """Each row's keys are centred at its own positions (counted in real tokens, as the model's position ids are
    under left padding), so a padded batch keeps and generates what each sequence alone does."""
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("llama", torch.float64)
    path = tmp_path / "rotary.json"
    record = measure_key_centers(model, lambda t: {"input_ids": [3 + b % 250 for b in t.encode()]}, "prose " * 30,
                                 tokens=120, rotary=True)  # Llama has no key bias: rotary only when asked
    assert record["format"] == "scissorhands-key-centers/2"
    save_key_centers(record, path)
    cfg = ScissorhandsConfig(budget=12, recent=4, drop=4, kv_bits=4, kv_group_size=8, kv_key_centers=str(path))
    batch_cache, _ = batch_and_alone(model, cfg, [30, 21, 9])
    for layer in batch_cache.budgeted_layers:  # each kept key was centred at its token's own position
        kv = layer.kv
        store = kv.store.inner if isinstance(kv.store, ResidualStore) else kv.store
        assert kv.store.wants_positions and kv.slots.seen.min() > cfg.budget  # every row has evicted
        for row, length in enumerate(kv.slots.lengths.tolist()):
            torch.testing.assert_close(store.k.pos[row, :, :length, 0], kv.slots.positions[row, :, :length],
                                       rtol=0, atol=0)


# -- the command line -----------------------------------------------------------------------------

_cli = run_cli


@pytest.mark.parametrize("flag,value,param", [("--kv-bits", "3", "kv-bits"), ("--kv-group-size", "6", "kv-group-size"),
                                              ("--kv-key-bits", "8", "kv-key-bits"),
                                              ("--kv-residual", "-1", "kv-residual"),
                                              ("--kv-residual", "4", "kv-residual")])
def test_cli_rejects_bad_kv_flags_in_one_line(capsys, flag, value, param):
    code, _, err = _cli(capsys, "generate", "--budget", "50", flag, value, "--prompt", "hi")
    assert code == 2 and err.strip().count("\n") == 0 and param in err


def test_cli_generate_and_eval_with_packed_kv(capsys, tmp_path):
    import json

    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    code, out, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "4", "--kv-bits", "4",
                          "--kv-key-bits", "8", "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "packed: data" in err and "against a bf16 full cache" in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--method", "full", "--kv-bits", "2",
                        "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "budget none" in err and "packed: data" in err and "no saving" not in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "8", "--kv-bits", "4",
                        "--kv-residual", "8", "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "full-precision residual" in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "400", "--kv-bits", "4", "--prompt", "hi",
                        "--max-new-tokens", "3", "--ignore-eos")
    assert code == 0, err
    assert "no saving, on" in err and "residual" in err  # 32 exact tokens outweigh what packing saves on 5
    data = tmp_path / "text.txt"
    data.write_text("All the world's a stage, and all the men and women merely players. " * 30)
    code, _, err = _cli(capsys, "eval", "--model", tiny, "--methods", "full,scissorhands", "--budgets", "0.5",
                        "--tasks", "ppl", "--text", str(data), "--seq-len", "64", "--num-samples", "2",
                        "--kv-bits", "4", "--kv-group-size", "8", "--kv-residual", "0", "--out", str(tmp_path / "out"))
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"full", "scissorhands"}
    assert all(r["key"]["settings"]["kv_bits"] == 4 and r["key"]["settings"]["kv_group_size"] == 8 for r in records)
    # the recorded K/V bytes are the packed ones: 4-bit K and V of 16 channels in groups of 8, 8 + 2 * 4 bytes each,
    # against 2 * 16 * 4 bytes in float32, for every token the cell keeps
    for r in records:
        assert r["kv_bytes"] == pytest.approx(r["mean_budget"] / r["mean_length"] * r["full_kv_bytes"] * 32 / 128)


def test_beam_search_reorders_packed_rows():
    """Beam search runs on packed K/V (rows reordered by select_batch, which the store test checks exactly)."""
    model = tiny_model("llama")
    ids, mask = left_padded([20, 14], seed=12)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    outs, caches = [], []
    for bits in (None, 8):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2, kv_bits=bits))
        with torch.no_grad():
            outs.append(model.generate(ids, cache=cache, **kw))
        caches.append(cache)
    assert outs[0].shape == outs[1].shape
    assert caches[1].memory_report()["peak_stored"] <= 12
    assert caches[1].memory_report()["kv_scale_bytes"] > 0


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


def test_cache_with_key_centres_scores_exactly_and_rejects_bad_files(tmp_path):
    import json

    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("gemma3")  # sliding layers: only the full-attention layers get centres
    record = measure_key_centers(model, lambda text: {"input_ids": [3 + b % 250 for b in text.encode()]},
                                 "the calibration text " * 20, tokens=200)
    path = tmp_path / "centres.json"
    save_key_centers(record, path)
    assert record["tokens"] == 200 and len(record["layers"]) == len(model_facts(model).full_layers)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=4, kv_group_size=8, kv_key_centers=str(path))
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    store = cache.budgeted_layers[0].kv.store
    store = store.inner if isinstance(store, ResidualStore) else store  # the default residual wraps it
    assert store.k.center is not None and cache.memory_report()["peak_stored"] <= 16
    plain_setup = ScoreSetup(get_method("scissorhands"), 16, replace(base, kv_key_centers=None))
    plain, _ = token_logprobs(model, ids, plain_setup)
    assert not torch.equal(fast, plain)  # the centres are really used

    bad = tmp_path / "bad.json"
    for content, message in [("{", "is not a key-centre file"), ('{"format": "x"}', "is not a key-centre file"),
                             (json.dumps({**record, "signature": {"layer_types": []}}), "another model"),
                             (json.dumps({**record, "layers": {}}), "no valid centres")]:
        bad.write_text(content)
        with pytest.raises(ValueError, match="^kv_key_centers: .*" + message):
            ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, kv_key_centers=str(bad)))
    with pytest.raises(ValueError, match="^kv_key_centers: no such file"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4,
                                                    kv_key_centers=str(tmp_path / "none.json")))
    with pytest.raises(ValueError, match="^kv_key_centers: needs packed K/V"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_key_centers=str(path)))


def test_cli_calibrate_then_generate_with_centres(capsys, tmp_path):
    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("A calibration text of plain prose, not the data under test. " * 20)
    out = tmp_path / "c.json"
    import json

    for frame, fmt in (("auto", 1), ("rotary", 2), ("fixed", 1)):  # the tiny Llama has no key bias: auto is fixed
        code, _, err = _cli(capsys, "calibrate", "--model", tiny, "--text", str(text), "--tokens", "128",
                            "--frame", frame, "--out", str(out))
        assert code == 0, err
        assert out.is_file() and "key centres of" in err
        assert json.loads(out.read_text())["format"] == f"scissorhands-key-centers/{fmt}"
        code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "4", "--kv-bits", "4",
                            "--kv-key-centers", str(out), "--prompt", "the quick brown fox " * 8,
                            "--max-new-tokens", "5", "--ignore-eos")
        assert code == 0, err
    for args, param in [(["--text", str(tmp_path / "missing.txt")], "text"), (["--tokens", "1"], "tokens"),
                        (["--frame", "sideways"], "frame")]:
        code, _, err = _cli(capsys, "calibrate", "--model", tiny, "--text", str(text), "--out", str(out), *args)
        assert code == 2 and err.strip().count("\n") == 0 and param in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--kv-key-centers", str(out),
                        "--prompt", "hi")
    assert code == 2 and "kv-key-centers" in err


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


def test_calibrated_rotary_centres_are_the_key_bias_before_rope_and_score_exactly(tmp_path):
    """On a Qwen2 whose key projection is only a bias, the centres measured before RoPE are that bias; with a real
    projection and a large bias, 4-bit keys around them score as token-by-token decoding does, and closer to the
    dense cache than fixed centres or none."""
    import copy
    import json

    from scissorhands.core.planning.memory_target import Shape
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    tokenize = lambda text: {"input_ids": [3 + b % 250 for b in text.encode()]}  # noqa: E731
    model = copy.deepcopy(tiny_model("qwen2"))  # the shared model is not touched
    gen = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        bias = layer.self_attn.k_proj.bias
        bias.data = torch.randn(bias.shape, generator=gen) * 8  # Qwen2's keys carry such offsets
    only_bias = copy.deepcopy(model)
    for layer in only_bias.model.layers:
        layer.self_attn.k_proj.weight.data.zero_()
    record = measure_key_centers(only_bias, tokenize, "calibration prose " * 20, tokens=150)
    assert record["format"] == "scissorhands-key-centers/2" and record["rotary"]["scaling"] == 1.0
    head_dim = only_bias.model.layers[0].self_attn.head_dim
    for i, layer in enumerate(only_bias.model.layers):
        want = layer.self_attn.k_proj.bias.detach().view(-1, head_dim)
        torch.testing.assert_close(torch.tensor(record["layers"][str(i)]), want, rtol=0, atol=1e-4)
    assert measure_key_centers(only_bias, tokenize, "calibration prose " * 20, tokens=150,
                               rotary=False)["format"] == "scissorhands-key-centers/1"

    paths = {}
    for frame in ("rotary", "fixed"):
        paths[frame] = tmp_path / f"{frame}.json"
        save_key_centers(measure_key_centers(model, tokenize, "calibration prose " * 20, tokens=150,
                                             rotary=frame == "rotary"), paths[frame])
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=8, kv_key_bits=4, kv_group_size=32, kv_residual=0,  # keys carry the loss
                   kv_key_centers=str(paths["rotary"]))
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert cache.budgeted_layers[0].kv.store.wants_positions
    shape = Shape(layers=2, kv_heads=2, head_dim_k=head_dim, head_dim_v=head_dim, itemsize=4)
    store = cache.budgeted_layers[0].kv.store
    assert PackedKVStore.bytes_for(base, shape, 10) == 10 * store.bytes_per_token_head()
    dense, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, CacheSettings()))
    gap = {}
    for frame in ("rotary", "fixed", None):
        settings = replace(base, kv_key_centers=None if frame is None else str(paths[frame]))
        lp, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, settings))
        gap[frame] = float((lp - dense).abs().mean())
    assert gap["rotary"] < 0.5 * gap["fixed"] and gap["rotary"] < 0.5 * gap[None], gap

    with pytest.raises(ValueError, match="^kv_key_centers: rotary centres .* merge"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, merge=True, kv_residual=0,
                                                    kv_key_centers=str(paths["rotary"])))
    with pytest.raises(ValueError, match="^kv_key_centers: rotary centres .* packed store only"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=2, kv_demote="4:0.5",
                                                    kv_key_centers=str(paths["rotary"])))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(paths["rotary"].read_text()), "rotary": {"inv_freq": [1.0]}}))
    with pytest.raises(ValueError, match="^kv_key_centers: .* no valid RoPE frequencies"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, kv_key_centers=str(bad)))


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


@pytest.mark.parametrize("r,tile,arch", [(1, 512, "llama"), (3, 512, "llama"), (3, 5, "qwen2"), (2, 1, "gemma3"),
                                         (3, 512, "gemma3")])
def test_scorer_equals_decoding_with_a_residual(r, tile, arch):
    """Blocked scoring (query tiles of 4, so limits spread across a tile) = token-by-token decoding, where each
    step reads its newest r tokens exact; and the residual is really in the path."""
    model = tiny_model(arch)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=4, kv_group_size=8, kv_tile=tile, kv_residual=r, query_tile=4)
    setup = ScoreSetup(get_method("scissorhands"), 16, base)
    fast, _ = token_logprobs(model, ids, setup)
    slow, cache = decode_logprobs(model, ids, setup)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)
    without, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, replace(base, kv_residual=0)))
    assert not torch.equal(fast, without)
    facts = model_facts(model)
    per_layer = r * facts.num_kv_heads * facts.head_dim * 2 * 4  # r tokens of K and V per KV head, float32
    report = cache.memory_report()
    assert report["kv_residual_bytes"] == len(facts.full_layers) * per_layer
    assert report["budgeted_kv_bytes"] == report["kv_data_bytes"] + report["kv_scale_bytes"] + per_layer * len(
        facts.full_layers)


def test_a_residual_covering_every_token_is_the_unquantised_cache():
    """Identity: when every query's residual reaches back to the first token, nothing is read packed."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(6))
    plain, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, CacheSettings()))
    covered, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None,
                                                       CacheSettings(kv_bits=2, kv_group_size=8, kv_residual=40)))
    packed, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None,
                                                      CacheSettings(kv_bits=2, kv_group_size=8)))
    torch.testing.assert_close(covered, plain, rtol=0, atol=1e-5)
    assert float((packed - plain).abs().max()) > 1e-3  # 2-bit without the residual is far off


@pytest.mark.parametrize("prefill", ["stream", "prompt-aware"])
def test_batched_generation_with_a_residual_equals_each_sequence_alone(prefill):
    """Left-padded rows of different lengths (ragged appends and evictions), with the residual."""
    model = tiny_model("llama", torch.float64)
    lengths = [30, 21, 9]
    ids, mask = left_padded(lengths, seed=4)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4, window=8, window_buckets=4, kv_bits=4, kv_group_size=8,
                             kv_residual=3, prefill=prefill,
                             **({"observe": 4} if prefill == "prompt-aware" else {}))

    def greedy(i, m):
        cache = ScissorhandsCache(model, cfg)
        with torch.no_grad():
            out = model.generate(i, attention_mask=m, cache=cache, max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        return out, cache

    batch, batch_cache = greedy(ids, mask)
    for row, n in enumerate(lengths):
        alone, _ = greedy(ids[row:row + 1, -n:], mask[row:row + 1, -n:])
        assert torch.equal(batch.sequences[row, -(n + 12):], alone.sequences[0])
        for a, b in zip(batch.logits, alone.logits):
            torch.testing.assert_close(a[row], b[0], rtol=0, atol=1e-9)
    report = batch_cache.memory_report()
    assert report["kv_residual_bytes"] == 3 * 2 * 2 * 3 * 16 * 2 * 8  # rows x layers x heads x r x (K+V) x fp64
    assert report["max_stored"] <= 12 and (prefill == "prompt-aware" or report["peak_stored"] <= 12)


def test_continuations_with_a_residual_equal_each_sequence_alone():
    model = tiny_model("gemma3")
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(3, 256, (40,), generator=gen).tolist()
    conts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 5, 3)]
    setup = ScoreSetup(get_method("scissorhands"), 20, replace(BASE, kv_bits=4, kv_group_size=8, kv_residual=3))
    for (lp, _), c in zip(continuation_logprobs(model, context, conts, setup), conts):
        alone, _ = token_logprobs(model, torch.tensor(context + c), setup)
        assert lp == pytest.approx(float(alone[-len(c):].sum()), abs=1e-4)


def test_beam_search_and_tile_reads_with_a_residual():
    """Beams reorder the residual with the packed rows; packed reads stay within a tile."""
    model = tiny_model("llama")
    ids, mask = left_padded([20, 14], seed=12)
    cfg = ScissorhandsConfig(budget=12, recent=3, kv_bits=4, kv_group_size=8, kv_residual=3, kv_tile=5)
    cache = ScissorhandsCache(model, cfg)
    spies = [ReadSpy(layer.kv.store) for layer in cache.budgeted_layers]
    for layer, spy in zip(cache.budgeted_layers, spies):
        layer.kv.store = spy
    with torch.no_grad():
        out = model.generate(ids, cache=cache, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False,
                             pad_token_id=0)
    assert out.shape[0] == 2 and all(0 < spy.widest <= 5 for spy in spies)
    assert cache.memory_report()["kv_residual_bytes"] == 6 * 2 * 2 * 3 * 32 * 4  # 6 beams, residual of 3


def test_residual_must_fit_the_recent_window_of_every_layer():
    model = tiny_model("llama")
    with pytest.raises(ValueError) as e:
        ScissorhandsCache(model, ScissorhandsConfig(budget=40, recent=0.1, kv_bits=4, kv_residual=8))
    assert str(e.value).startswith("kv_residual:") and "\n" not in str(e.value)
    ScissorhandsCache(model, ScissorhandsConfig(budget=40, recent=0.2, kv_bits=4, kv_residual=8))


def test_default_residual_is_32_tokens_capped_by_each_layers_recent_window():
    """kv_residual=None (the default): 32 exact tokens with packed K/V, at most the recent window of a layer that
    evicts; none without packing, with merge, or in the paper preset; an explicit number is taken as given."""
    from scissorhands.core.settings.config import DEFAULT_RESIDUAL

    assert DEFAULT_RESIDUAL == 32 and CacheSettings().kv_residual is None
    assert CacheSettings(kv_bits=4).residual_for(400) == 32
    assert CacheSettings(kv_bits=4).residual_for(64) == 16  # recent 0.25 x 64
    assert CacheSettings(kv_bits=4).residual_for(64, evicts=False) == 32
    assert CacheSettings().residual_for(400) == 0
    assert CacheSettings(kv_bits=4, merge=True).residual_for(400) == 0
    assert CacheSettings(kv_bits=4, preset="paper").residual_for(400) == 0
    assert CacheSettings(kv_bits=4, kv_residual=5).residual_for(400) == 5
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=40, kv_bits=4, schedule=(24, 56)))
    assert [layer.kv.store.residual for layer in cache.budgeted_layers] == [6, 14]
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(2))
    full = ScoreSetup(get_method("full"), None, CacheSettings(kv_bits=4, kv_group_size=8))
    cache = full.make_cache(model, 60)
    assert [layer.kv.store.residual for layer in cache.budgeted_layers] == [32, 32]
    token_logprobs(model, ids, full, cache=cache)
    assert cache.memory_report()["kv_residual_bytes"] == 2 * 2 * 32 * 32 * 4  # layers x heads x 32 x (K+V) x fp32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_residual_in_bf16_rounds_alike_when_decoded_and_when_blocked(arch):
    """In bf16 a decoded step and a blocked one must sum the packed and the exact value products alike: with
    the residual the scorer stays as close to decoding as without it, and a padded batch equals each row."""
    model = tiny_model(arch, torch.bfloat16)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    gaps = {}
    for r in (0, 3):
        setup = ScoreSetup(get_method("scissorhands"), 16, replace(BASE, kv_bits=4, kv_group_size=8, kv_residual=r,
                                                                   query_tile=4))
        fast, _ = token_logprobs(model, ids, setup)
        slow, _ = decode_logprobs(model, ids, setup)
        gaps[r] = float((fast - slow).abs().max())
    assert gaps[3] <= gaps[0] + 1e-3, gaps
    lengths = [30, 21, 9]
    batch_ids, mask = left_padded(lengths, seed=4)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4, kv_bits=4, kv_group_size=8, kv_residual=3)

    def logits(i, m):
        with torch.no_grad():
            return model.generate(i, attention_mask=m, cache=ScissorhandsCache(model, cfg), max_new_tokens=8,
                                  do_sample=False, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True).logits

    batch = logits(batch_ids, mask)
    for row, n in enumerate(lengths):
        for a, b in zip(batch, logits(batch_ids[row:row + 1, -n:], mask[row:row + 1, -n:])):
            torch.testing.assert_close(a[row].float(), b[0].float(), rtol=0, atol=1e-3)


def test_a_text_the_budget_covers_takes_the_full_residual_whatever_the_method():
    """Nothing is evicted when the budget covers the text: an explicit residual larger than the recent window
    of a budget that size is no error, and the result is the full method's."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(8))
    base = CacheSettings(kv_bits=4, kv_group_size=8, kv_residual=16)
    covered, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 64, base))
    full, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, base))
    assert torch.equal(covered, full)
    default = CacheSettings(kv_bits=4, kv_group_size=8)
    covered, _ = token_logprobs(model, ids, ScoreSetup(get_method("h2o"), 64, default))
    full, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, default))
    assert torch.equal(covered, full)


def test_a_layer_refuses_a_residual_its_recent_window_or_merging_cannot_keep():
    from scissorhands.core.methods.scissorhands import Scissorhands

    with pytest.raises(ValueError, match="^kv_residual: "):
        BudgetedKV(16, 2, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3))
    with pytest.raises(ValueError, match="^kv_residual: "):
        BudgetedKV(16, 4, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3), merge=True)
    BudgetedKV(16, 3, 4, Scissorhands(), store=ResidualStore(PackedKVStore(4, 8), 3))


def test_eval_refuses_a_residual_that_does_not_fit_before_any_cell(capsys, tmp_path):
    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    capsys.readouterr()  # the saving's progress bar
    data = tmp_path / "text.txt"
    data.write_text("All the world's a stage, and all the men and women merely players. " * 30)
    code, _, err = _cli(capsys, "eval", "--model", tiny, "--methods", "full,scissorhands", "--budgets", "0.5",
                        "--tasks", "ppl", "--text", str(data), "--seq-len", "64", "--num-samples", "2",
                        "--recent", "0.1", "--kv-bits", "4", "--kv-residual", "8", "--out", str(tmp_path / "out"))
    assert code == 2 and err.strip().count("\n") == 0 and "kv-residual" in err
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_eval_records_count_each_layers_residual_from_the_schedule():
    from scissorhands.tools.eval.runner import kv_residual_bytes

    model = tiny_model("llama")  # 2 full layers, 2 KV heads of 16 channels, float32
    per_layer_token = 2 * 2 * 16 * 4
    settings = CacheSettings(kv_bits=4, schedule=(100, 300))
    assert kv_residual_bytes(model, settings, 200) == (25 + 32) * per_layer_token  # recent 0.25 x 100 caps layer 0
    assert kv_residual_bytes(model, CacheSettings(kv_bits=4), 200) == 2 * 32 * per_layer_token
    assert kv_residual_bytes(model, CacheSettings(), 200) == 0
