"""Scoring and prefill options through the transformers cache: every option keeps the compressed scorer exact, the
prompt-aware prefill keeps its invariants, a batch equals each sequence alone and continuations score as decoded
(each option against the naive reference, and the paper preset: tests/core/test_options.py)."""

import pytest
import torch
from reference import reference_stream
from test_reference import kept_of, make_inputs, run_layer
from test_scoring import decode_logprobs

from conftest import left_padded, scored_and_decoded, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig, get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs

OPTIONS = {
    "sinks": dict(sinks=4),
    "mean": dict(importance="mean", mean_cap=None),
    "mean-capped": dict(importance="mean", mean_cap=6),
    "value-weighted": dict(value_weighted=True),
    "recent-fraction": dict(recent=0.25),
    "merge": dict(merge=True),
    "all": dict(sinks=2, importance="mean", value_weighted=True, recent=0.3, drop=2, merge=True),
}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("option", OPTIONS)
def test_options_keep_the_scorer_exact(arch, option):
    base = CacheSettings(**{**dict(window=8, window_buckets=4, drop=5, recent=3), **OPTIONS[option]})
    model = tiny_model(arch)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    setup = ScoreSetup(get_method("scissorhands"), 16, base)
    fast, _ = token_logprobs(model, ids, setup)
    slow, cache = decode_logprobs(model, ids, setup)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert cache.memory_report()["peak_stored"] <= 16
    if base.sinks:
        for layer in cache.budgeted_layers:
            assert set(range(base.sinks)) <= set(layer.stored_positions(0).flatten().tolist())


def test_a_mean_cap_above_the_sequence_is_the_plain_mean():
    """``mean_cap`` changes nothing while no token has been scored by more queries than the cap (so the 2,048
    default leaves every sequence of 2,048 tokens or fewer as the plain mean had it), and changes the scores
    once tokens are older than the cap."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(4))

    def scored(cap):
        settings = CacheSettings(importance="mean", mean_cap=cap, recent=3, drop=2)
        return token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 12, settings))[0]

    plain = scored(None)
    assert torch.equal(scored(48), plain) and torch.equal(scored(2048), plain)
    # A cap below the tokens' ages ranks the old ones by their sum, which keeps other tokens (this tiny model
    # keeps its first tokens either way, so the layer is fed random queries and keys, as the reference is).
    case = dict(b=1, h_kv=1, group=2, t=60, seed=1, pads=[0])
    q, k, v, valid = make_inputs(case)
    params = dict(budget=12, recent=3, drop=2, window=None, bucket_steps=None, importance="mean", scaling=0.5)
    kept = {cap: kept_of(run_layer(q, k, v, valid, [1] * 60, mean_cap=cap, **params)[1], 1, 1)
            for cap in (None, 60, 4)}
    assert kept[60] == kept[None] != kept[4]
    assert kept[4] == reference_stream(q, k, v, valid, mean_cap=4, **params)[1]


def test_sinks_survive_any_pressure():
    model = tiny_model("qwen2")
    ids, mask = left_padded([40, 23], seed=2)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, recent=2, drop=1, sinks=3))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=30, do_sample=False, pad_token_id=0)
    for layer in cache.budgeted_layers:
        for row in range(2):
            for head in layer.stored_positions(row).tolist():
                assert {0, 1, 2} <= set(head) and len(head) <= 10


PROMPT_AWARE = CacheSettings(recent=3, drop=4, window=8, window_buckets=4, prefill="prompt-aware", observe=6)


@pytest.mark.parametrize("name", ["scissorhands", "h2o", "tova", "streaming", "local", "random"])
def test_prompt_aware_continuations_equal_decoding_after_the_prompt(name):
    """Prompt as one chunk, then the continuation at once = the continuation token by token."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    context = torch.randint(3, 256, (40,), generator=gen).tolist()
    cont = torch.randint(3, 256, (12,), generator=gen).tolist()
    setup = ScoreSetup(get_method(name), 16, PROMPT_AWARE, seed=1)
    total, decoded, cache = scored_and_decoded(model, context, cont, setup)
    assert total == pytest.approx(decoded, abs=1e-4)
    report = cache.memory_report()
    assert report["max_stored"] <= 16 and report["peak_stored"] == len(context)  # the prompt was held once


def test_prompt_aware_batch_equals_each_sequence_alone_and_keeps_the_last_queries():
    model = tiny_model("gemma3", torch.float64)
    ids, mask = left_padded([36, 30, 9], seed=6)
    cfg = PROMPT_AWARE.with_budget(24)  # the observed tokens kept whole are at most a quarter of the budget: 6

    def run(rows):
        cache = ScissorhandsCache(model, cfg)
        with torch.no_grad():
            out = model.generate(ids[rows], attention_mask=mask[rows], cache=cache, max_new_tokens=1,
                                 do_sample=False, pad_token_id=0)
        return out[:, -1], cache

    together, cache = run([0, 1, 2])
    for row, n in enumerate([36, 30, 9]):
        alone, single = run([row])
        assert torch.equal(together[row], alone[0])
        for a, b in zip(cache.budgeted_layers, single.budgeted_layers):
            kept = a.stored_positions(row)
            assert torch.equal(kept, b.stored_positions(0))
            assert kept.shape[-1] == min(n, 24)
            if n > 24:  # the observation window (the prompt's last 6 tokens) is kept whole
                for head in kept.tolist():
                    assert set(range(n - 6, n)) <= set(head)


def test_merging_keeps_the_mass_and_changes_nothing_without_eviction():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(4))
    merged = CacheSettings(recent=3, drop=5, merge=True)
    plain = ScoreSetup(get_method("scissorhands"), 64, CacheSettings(recent=3, drop=5))
    same = ScoreSetup(get_method("scissorhands"), 64, merged)
    torch.testing.assert_close(token_logprobs(model, ids, same)[0], token_logprobs(model, ids, plain)[0])
    cache = ScissorhandsCache(model, merged.with_budget(16))
    with torch.no_grad():
        model(ids[None], cache=cache)
    for layer in cache.budgeted_layers:
        mass = layer.kv.merge.mass[0, :, : int(layer.slots.lengths[0])]
        # every token seen is accounted for: kept ones plus what was folded into them
        torch.testing.assert_close(mass.sum(dim=-1), torch.full((mass.shape[0],), 48.0))
        assert bool((mass >= 1).all())
