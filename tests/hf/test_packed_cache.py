"""Packed low-bit K/V through the transformers cache: the scorer equals decoding, a batch equals each sequence
alone, beams reorder packed rows, the residual and the memory report (the quantiser, the stores and their bytes:
tests/core/test_packed.py)."""

from dataclasses import replace

import pytest
import torch
from test_packed import ReadSpy
from test_scoring import BASE, decode_logprobs

from conftest import batch_and_alone, left_padded, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.core.stores.packed import PackedKVStore
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs, token_logprobs


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
