"""The exact scorer equals decoding through the cache; every method runs through it."""

import pytest
import torch

from conftest import tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import METHODS, get_method
from scissorhands.core.planning.assembly import budget_tokens
from scissorhands.core.settings.config import CacheSettings
from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs, token_logprobs

BASE = ScissorhandsConfig(budget=16, recent=3, drop=5, window=8, window_buckets=4)


def decode_logprobs(model, ids, setup):
    """Reference: feed one token at a time through the cache, as generation would."""
    cache = setup.make_cache(model, ids.shape[-1])
    out = []
    with torch.no_grad():
        for t in range(ids.shape[-1] - 1):
            logits = model(ids[None, t:t + 1], cache=cache).logits[0, -1]
            out.append(torch.log_softmax(logits.float(), -1)[ids[t + 1]])
    return torch.stack(out), cache


def assert_scorer_equals_decoding(name, arch="llama", base=BASE):
    """The exactness every method (and store) must show: one blocked forward = token-by-token decoding, budget held."""
    model = tiny_model(arch)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    setup = ScoreSetup(get_method(name), 16, base, seed=5)
    fast, _ = token_logprobs(model, ids, setup)
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method(name), 16, base, seed=5))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert isinstance(cache, ScissorhandsCache) and cache.memory_report()["peak_stored"] <= 16
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)


@pytest.mark.parametrize("name", [m for m in METHODS if m != "full"])
def test_scorer_equals_decoding(name):
    assert_scorer_equals_decoding(name)


def test_full_method_and_large_budget_equal_plain_forward():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    plain = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
    for setup in (ScoreSetup(get_method("full"), None, BASE), ScoreSetup(get_method("scissorhands"), 30, BASE)):
        torch.testing.assert_close(token_logprobs(model, ids, setup)[0], plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["full", "scissorhands", "h2o", "streaming"])
def test_continuations_equal_scoring_each_sequence_alone(name):
    model = tiny_model("gemma3")
    gen = torch.Generator().manual_seed(3)
    context = torch.randint(3, 256, (40,), generator=gen).tolist()
    conts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 5, 3)]
    setup = ScoreSetup(get_method(name), 20, BASE)
    got = continuation_logprobs(model, context, conts, setup)
    for (total, greedy), cont in zip(got, conts):
        lp, hit = token_logprobs(model, torch.tensor(context + cont), setup)
        assert total == pytest.approx(float(lp[-len(cont):].sum()), abs=1e-4)
        assert greedy == bool(hit[-len(cont):].all())


def test_methods_keep_what_they_promise():
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (60,), generator=torch.Generator().manual_seed(4))

    def kept(name):
        setup = ScoreSetup(get_method(name), 16, BASE)
        cache = setup.make_cache(model, 60)
        with torch.no_grad():
            model(ids[None], cache=cache)
        return [set(p.tolist()) for layer in cache.budgeted_layers for p in layer.stored_positions(0)]

    for heads in kept("streaming"):
        assert {0, 1, 2, 3} <= heads  # attention sinks
    for heads in kept("local"):
        assert heads == set(range(60 - len(heads), 60))  # a contiguous recent window
    assert kept("random") != kept("local")


def test_budget_resolution_and_errors():
    s = CacheSettings(recent=8, sinks=2)  # protected: 10
    assert budget_tokens(0.2, 100, s) == 20
    assert budget_tokens(0.05, 100, s) == 11  # never below recent + sinks + 1
    assert budget_tokens(64, 1000, s) == 64
    assert budget_tokens(64, None, s) == 64  # a count needs no length
    with pytest.raises(ValueError, match="^budget: a fraction"):
        budget_tokens(0.5, None, s)
    with pytest.raises(ValueError, match="^budgets:"):
        budget_tokens(0, 100, s, name="budgets")
    with pytest.raises(ValueError, match="^methods:"):
        get_method("nope")


def test_shared_settings_reach_the_method_unless_it_defines_them():
    base = ScissorhandsConfig(budget=16, recent=3, window=50, importance="count")
    assert get_method("scissorhands").configure(base, 20).importance == "count"
    assert get_method("scissorhands").configure(base, 20).window == 50
    assert get_method("h2o").configure(base, 20).window is None
    tova = get_method("tova").configure(base, 20)
    assert (tova.window, tova.recent, tova.importance) == (1, 0, "sum")


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "gemma3", "gpt2", "opt"])
@pytest.mark.parametrize("name", ["full", "scissorhands"])
def test_logits_in_chunks_equal_one_forward(arch_name, name, monkeypatch):
    """Long windows make their logits a chunk of positions at a time; the scores equal the model's own forward.

    Gemma 3 is given a final softcap so the capped head is the one checked. The tolerance is float32's across two
    matmul shapes (a chunk of rows against the whole window), not a bitwise pin.
    """
    import scissorhands.hf.scoring as scoring

    model = tiny_model(arch_name)
    ids = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(4))
    setup = ScoreSetup(get_method(name), 16, BASE)
    if arch_name == "gemma3":
        monkeypatch.setattr(model.config, "final_logit_softcapping", 3.0)
    assert scoring._logit_head(model) is not None
    monkeypatch.setattr(scoring, "LOGIT_CHUNK", 7)  # 39 positions: five full chunks and a ragged one
    chunked, hits = token_logprobs(model, ids, setup)
    with torch.no_grad():
        logits = model(ids[None], cache=setup.make_cache(model, 40)).logits[0, :-1]
    torch.testing.assert_close(chunked, torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0],
                               rtol=0, atol=1e-5)
    assert torch.equal(hits, logits.argmax(-1) == ids[1:])


def test_a_model_that_scales_its_logits_is_scored_through_its_own_forward(monkeypatch):
    import scissorhands.hf.scoring as scoring

    model = tiny_model("llama")
    monkeypatch.setattr(model.config, "logit_scale", 0.5, raising=False)
    assert scoring._logit_head(model) is None
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5))
    setup = ScoreSetup(get_method("full"), None, BASE)
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    torch.testing.assert_close(token_logprobs(model, ids, setup)[0],
                               torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("settings", [
    {},
    {"kv_bits": 4, "kv_group_size": 8},
    {"kv_bits": 2, "kv_group_size": 8, "kv_demote": "16:0.5,4:0.75"},
    {"schedule": (24, 40)},
])
def test_the_plans_byte_model_is_what_the_cache_allocates(settings):
    """What eval records (``ScoreSetup.kv_bytes``: the plan's byte model, each layer's store, residual and
    centres) against the bytes the cache built from the same plan holds after a sequence longer than its budget,
    and a sequence the budget covers (transformers' own cache, counted at the model's dtype)."""
    from scissorhands.hf.modelinfo import model_facts

    model = tiny_model("llama")
    setup = ScoreSetup(get_method("scissorhands"), 32, CacheSettings(recent=4, **settings))
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    cache = setup.make_cache(model, 80)
    with torch.no_grad():
        model(ids, cache=cache)
    assert setup.kv_bytes(model, 80) == cache.memory_report()["budgeted_kv_bytes"]
    covered = ScoreSetup(get_method("scissorhands"), 100, CacheSettings(recent=4))
    assert covered.cache_plan(model, 80) is None
    assert covered.kv_bytes(model, 80) == 80 * model_facts(model).kv_bytes_per_token(4)


def test_a_planned_setup_holds_its_plan_until_a_task_changes_its_settings():
    """The eval runner plans each item once (``ScoreSetup.planned``); a task that changes the settings (a text
    scored whole streams its prompt) or adds protected spans gets a cache planned from what it asked."""
    from dataclasses import replace

    from scissorhands.hf.cache import cache_plan

    model = tiny_model("llama")
    method = get_method("scissorhands")
    made = cache_plan(model, CacheSettings(recent=4, prefill="prompt-aware"), method(), budget=0.4, length=40)
    setup = ScoreSetup.planned(made, method)
    assert setup.budget == 16 and setup.cache_plan(model, 40) is made
    moved = replace(setup, base=setup.base.with_plugin("prefill", "stream"))
    assert moved.cache_plan(model, 40).config.prefill == "stream" and made.config.prefill == "prompt-aware"
    guarded = replace(setup, protect=((0, 3),)).cache_plan(model, 40)
    assert guarded.config == made.config and guarded.protection is not None and made.protection is None
