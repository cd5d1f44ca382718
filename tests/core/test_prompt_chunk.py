"""The chunked prompt-aware prefill (``prompt_chunk``): a prompt taken C tokens at a time, peak B + C.

Checked against a naive reference written here, token by token and head by head in float64: each chunk attends
exactly over what is stored plus itself (causally), then the chunk's last ``observe`` queries score every
stored token, the scores are max-pooled over ``pool`` neighbouring slots, the chunk's watched tokens, the
recent window and the protected positions are kept, and the lowest scores go down to the budget (the older
first among equals).
"""

import math

import pytest
import torch

from conftest import batch_and_alone, left_padded, scored_and_decoded, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.attend.prefill import PromptAware
from scissorhands.core.methods import get_method
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.hf.cache import ScissorhandsLayer
from scissorhands.hf.scoring import ScoreSetup


def naive_chunked(q, k, v, *, budget, recent, observe, pool, chunk, scaling, sinks=0):
    """Outputs (B, H_q, T, D) and kept positions per (row, head), in stored order."""
    b, h_q, t, d = q.shape
    h = k.shape[1]
    g = h_q // h
    out = torch.zeros_like(q)
    kept = []
    for row in range(b):
        row_kept = []
        for head in range(h):
            stored: list[int] = []  # positions, in stored order
            for start in range(0, t, chunk):
                end = min(t, start + chunk)
                new = list(range(start, end))
                slots = stored + new
                keys = k[row, head, slots]
                values = v[row, head, slots]
                attn = torch.zeros(len(slots), dtype=torch.float64)
                for p in new:
                    see = torch.tensor([s <= p for s in slots])
                    for qh in range(head * g, head * g + g):
                        logits = (q[row, qh, p] @ keys.T) * scaling
                        logits[~see] = -math.inf
                        probs = torch.softmax(logits, -1)
                        out[row, qh, p] = probs @ values
                        if p >= end - observe:
                            attn += probs
                if len(slots) <= budget:
                    stored = slots
                    continue
                if pool > 1:
                    attn = torch.nn.functional.max_pool1d(attn[None, None], pool, 1, pool // 2)[0, 0]
                score = attn.clone()
                for j, p in enumerate(slots):
                    if p >= end - min(observe, budget // 4):  # the observed tokens kept: up to a quarter of the budget
                        score[j] = torch.finfo(torch.float64).max
                    if j >= len(slots) - recent or p < sinks:
                        score[j] = math.inf
                order = sorted(range(len(slots)), key=lambda j: (float(score[j]), j))
                gone = set(order[: len(slots) - budget])
                stored = [p for j, p in enumerate(slots) if j not in gone]
            row_kept.append(stored)
        kept.append(row_kept)
    return out, kept


def run_chunked(q, k, v, *, budget, recent, observe, pool, chunk, scaling, sinks=0):
    layer = ScissorhandsLayer(budget, recent, 1, ImportanceState("sum", None, 1), Scissorhands(), sinks=sinks,
                              prefill=PromptAware(observe, pool, chunk=chunk))
    kwargs = {}
    layer.update(k, v, kwargs=kwargs)
    out = layer.attend(q, k, v, None, scaling)
    return out, layer


@pytest.mark.parametrize("t,budget,chunk,recent,observe,pool,sinks", [
    (40, 12, 8, 3, 4, 3, 0), (40, 12, 5, 2, 2, 1, 1), (33, 10, 16, 0, 6, 5, 0), (50, 20, 7, 4, 3, 7, 2),
    (24, 8, 24, 2, 4, 3, 0)])
def test_chunked_prompt_aware_matches_the_naive_reference(t, budget, chunk, recent, observe, pool, sinks):
    gen = torch.Generator().manual_seed(t + chunk)
    q = torch.randn(2, 4, t, 8, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(2, 2, t, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, t, 8, generator=gen, dtype=torch.float64)
    params = dict(budget=budget, recent=recent, observe=observe, pool=pool, chunk=chunk, scaling=0.5, sinks=sinks)
    want_out, want_kept = naive_chunked(q, k, v, **params)
    out, layer = run_chunked(q, k, v, **params)
    torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-9)
    assert [[layer.stored_positions(r)[hd].tolist() for hd in range(2)] for r in range(2)] == want_kept
    assert layer.slots.peak <= budget + chunk  # the documented peak
    assert int(layer.slots.lengths.max()) <= budget and layer.kv.capacity == budget


def test_a_chunk_as_long_as_the_prompt_is_the_held_prefill():
    """``prompt_chunk`` >= the prompt: bitwise the unchunked prompt-aware prefill."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    results = []
    for chunk in (None, 40, 64):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, prefill="prompt-aware", prompt_chunk=chunk))
        with torch.no_grad():
            results.append((model(ids, cache=cache).logits, [layer.stored_positions(0) for layer in
                                                               cache.budgeted_layers]))
    for logits, kept in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kept, results[0][1]))


def test_chunked_prompt_aware_batch_equals_each_sequence_alone():
    batch_and_alone(tiny_model("qwen2", torch.float64),
                    ScissorhandsConfig(budget=10, prefill="prompt-aware", prompt_chunk=6, observe=4), [31, 22, 9],
                    seed=6)  # seed 5 meets EOS early, which the helper does not allow


def test_chunked_prompt_aware_scorer_equals_decoding_after_the_prompt():
    """The exact scorer's continuation equals decoding it token by token after a chunked prompt."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    context = torch.randint(3, 256, (45,), generator=gen).tolist()
    cont = torch.randint(3, 256, (10,), generator=gen).tolist()
    settings = CacheSettings(recent=3, drop=4, prefill="prompt-aware", observe=5, prompt_chunk=12)
    setup = ScoreSetup(get_method("scissorhands"), 16, settings)
    total, decoded, cache = scored_and_decoded(model, context, cont, setup)
    assert total == pytest.approx(decoded, abs=1e-4)
    report = cache.memory_report()
    assert report["max_stored"] <= 16 and report["peak_stored"] <= 16 + 12


def test_generate_with_padding_and_a_chunked_prompt():
    model = tiny_model("gemma3", torch.float64)
    ids, mask = left_padded([30, 17], seed=2)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, prefill="prompt-aware", prompt_chunk=7))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for layer in cache.budgeted_layers:
        assert layer.slots.peak <= 17 and int(layer.slots.lengths.max()) <= 10


@pytest.mark.parametrize("fields,match", [
    ({"prompt_chunk": 0}, r"^prompt_chunk: "),
    ({"prompt_chunk": 8}, r"^prompt_chunk: a setting of prefill='prompt-aware', got prefill='stream'"),
])
def test_prompt_chunk_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        CacheSettings(**fields)


def test_vllm_refuses_prompt_chunk():
    from scissorhands.vllm.settings import parse

    with pytest.raises(ValueError, match=r"^prompt_chunk: not supported by the vLLM adapter"):
        parse({"method": "scissorhands", "budget": 16, "prompt_chunk": "64"})
    # the increasing schedule's own setting: refused as the schedule is, not as a setting of an unchosen one
    with pytest.raises(ValueError, match=r"^increasing_slope: not supported by the vLLM adapter"):
        parse({"method": "scissorhands", "budget": 16, "increasing_slope": "0.3"})
    with pytest.raises(ValueError, match=r"^prefill_drop: a setting of prefill='stream', got prefill='prompt-aware'$"):
        parse({"method": "scissorhands", "budget": 16, "prefill_drop": "4"})


def test_perplexity_keeps_a_chunked_prompt_aware_prefill_and_streams_a_held_one():
    """A text scored whole: the held prompt-aware prefill would hold it all (the full cache), so ppl streams
    it; a chunked one scores each chunk over what the chunks before it left, so it is kept."""
    from scissorhands.tools.eval.tasks import streamed

    method = get_method("scissorhands")
    held = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware"))
    chunked = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware", prompt_chunk=8))
    assert streamed(held).base.prefill == "stream"
    assert streamed(chunked).base == chunked.base
    # prompt-aware's own settings leave with it: a streamed prefill does not take them
    observed = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware", observe=4, pool=3))
    assert streamed(observed).base == CacheSettings(prefill="stream")
