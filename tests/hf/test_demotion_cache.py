"""Demotion (``kv_demote``) through the transformers cache: the scorer equals decoding, a residual wraps the tiered
store, a batch equals each sequence alone, beams run, and the bytes are what it allocates (the tiered store and
layer against the naive reference: tests/core/test_demotion.py)."""

from dataclasses import replace

import pytest
import torch
from test_scoring import BASE, decode_logprobs

from conftest import batch_and_alone, left_padded, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.core.stores import ResidualStore
from scissorhands.core.stores.tiered import TieredKVStore
from scissorhands.hf.scoring import ScoreSetup, token_logprobs


def test_caps_at_the_budget_are_the_packed_store_at_the_top_width():
    """Nothing demoted (every cap covers the text) and no eviction: bitwise the packed cache at the widest width."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(2))
    packed = replace(BASE, kv_bits=4, kv_group_size=8, kv_residual=0)
    tiered = replace(packed, kv_bits=2, kv_demote=((4, 0.5),))  # 100 tokens at 4 bits: the whole text
    a, cache_a = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 200, packed))
    b, cache_b = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 200, tiered))
    assert isinstance(cache_b.budgeted_layers[0].kv.store, TieredKVStore)
    assert torch.equal(a, b)


@pytest.mark.parametrize("demote,bits", [("4:0.5", 2), ("16:0.4,4:0.7", 2), ("8:0.5", 4), ("16:0.4,8:0.55,4:0.7", 2)])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_scorer_equals_decoding_with_demotion(demote, bits, arch):
    """One blocked forward = token-by-token decoding through the tiered cache, demotions and evictions included."""
    model = tiny_model(arch)
    ids = torch.randint(3, 256, (56,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=bits, kv_demote=demote, kv_group_size=8, kv_tile=5, kv_residual=0)
    setup = ScoreSetup(get_method("scissorhands"), 20, base)
    fast, _ = token_logprobs(model, ids, setup)
    slow, cache = decode_logprobs(model, ids, setup)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)
    packed, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 20, replace(base, kv_demote=None)))
    assert not torch.equal(fast, packed)  # the demotion is really in the path


def test_a_residual_wraps_the_tiered_store():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (50,), generator=torch.Generator().manual_seed(3))
    base = replace(BASE, kv_bits=2, kv_demote="16:0.4,4:0.7", kv_group_size=8, kv_residual=2)
    setup = ScoreSetup(get_method("scissorhands"), 20, base)
    fast, _ = token_logprobs(model, ids, setup)
    slow, cache = decode_logprobs(model, ids, setup)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    store = cache.budgeted_layers[0].kv.store
    assert isinstance(store, ResidualStore) and isinstance(store.inner, TieredKVStore)


def test_batched_generation_with_demotion_equals_each_sequence_alone():
    """Tokens, stored positions and every slot's width: a padded batch holds what each sequence holds alone."""
    model = tiny_model("llama", torch.float64)
    cfg = ScissorhandsConfig(budget=14, recent=3, drop=2, window=8, window_buckets=4, kv_bits=2,
                             kv_demote="16:0.36,4:0.72", kv_group_size=8)
    batch_cache, alone_caches = batch_and_alone(model, cfg, [30, 21, 9])
    for row, alone_cache in enumerate(alone_caches):
        for lb, la in zip(batch_cache.budgeted_layers, alone_cache.budgeted_layers):
            wb = lb.kv.tiers.slot_widths(lb.slots.length)[row, :, : int(lb.slots.lengths[row])]
            wa = la.kv.tiers.slot_widths(la.slots.length)[0, :, : int(la.slots.lengths[0])]
            assert torch.equal(wb, wa)


def test_peak_bytes_of_a_tiered_cache_are_what_it_allocates():
    """memory_budget.peak_bytes counts the tiered store's pools, planes and indices as the cache allocates them."""
    from scissorhands.core.planning.memory_target import peak_bytes
    from scissorhands.hf.cache import memory_shape

    model = tiny_model("llama")
    cfg = ScissorhandsConfig(budget=30, kv_bits=2, kv_demote="16:0.3,4:0.6", kv_group_size=8, recent=4, drop=2)
    cache = ScissorhandsCache(model, cfg)
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    report = cache.memory_report()
    held = report["budgeted_kv_bytes"] + report["importance_bytes"] + report["position_bytes"]
    assert report["peak_stored"] == 30
    assert peak_bytes(cfg, memory_shape(model)) == held


def test_beam_search_runs_with_demotion():
    model = tiny_model("llama")
    ids, mask = left_padded([20, 14], seed=12)
    cfg = ScissorhandsConfig(budget=12, recent=2, drop=2, kv_bits=2, kv_demote="16:0.34,4:0.67", kv_group_size=8)
    cache = ScissorhandsCache(model, cfg)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, num_beams=3, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (2, 28)
    report = cache.memory_report()
    assert report["peak_stored"] <= 12 and set(report["tokens_by_width"]) == {"16", "4", "2"}
    assert report["tokens_by_width"]["2"] > 0
