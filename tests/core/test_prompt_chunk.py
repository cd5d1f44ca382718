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
from driver import CoreLayer

from scissorhands.core.attend.prefill import PromptAware
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.tokens.importance import ImportanceState


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
    layer = CoreLayer(budget, recent, 1, ImportanceState("sum", None, 1), Scissorhands(), sinks=sinks,
                      prefill=PromptAware(observe, pool, chunk=chunk))
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


@pytest.mark.parametrize("fields,match", [
    ({"prompt_chunk": 0}, r"^prompt_chunk: "),
    ({"prompt_chunk": 8}, r"^prompt_chunk: a setting of prefill='prompt-aware', got prefill='stream'"),
])
def test_prompt_chunk_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        CacheSettings(**fields)
