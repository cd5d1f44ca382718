"""After a prompt-aware prefill, decoding ranks the kept prompt as the selection did.

The prompt-aware prefill chooses what a layer keeps by the attention of the prompt's last ``observe`` queries.
The state then holds that judgement (``TokenState.judged``): were it to keep the attention of all the prompt's
queries, the first eviction while decoding would rank the kept tokens by what the selection never looked at, and
drop the very tokens the question picked (a multikey key on Qwen2.5-Coder-0.5B, docs/results.md).

Checked against a naive reference written here in float64: the watched queries' attention per slot, max-pooled,
and its rate per watched query that saw the slot. The first decode step's eviction must drop the ``drop`` kept
tokens of lowest rate (``mean``) or pooled sum (``sum``) outside the recent window, for any window and cap:
the state ranks each kept token by the judgement (a rate rounded to the bits that keep it exact, which at these
lengths is 18 or more and leaves these random rates apart).
"""

import pytest
import torch
from driver import CoreLayer

from scissorhands.core.attend.prefill import PromptAware
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState, queries_in_window
from scissorhands.core.tokens.judgement import ring_steps


def naive_judgement(q, k, observe, pool, scaling):
    """(B, H_kv, T) float64: the last ``observe`` queries' attention per slot (summed over a group's heads),
    max-pooled over ``pool`` slots, and divided by how many of those queries saw each slot."""
    b, h_q, t, _ = q.shape
    h = k.shape[1]
    g = h_q // h
    attn = torch.zeros(b, h, t, dtype=torch.float64)
    for row in range(b):
        for head in range(h):
            for p in range(t - observe, t):
                for qh in range(head * g, head * g + g):
                    logits = (q[row, qh, p] @ k[row, head, : p + 1].T) * scaling
                    attn[row, head, : p + 1] += torch.softmax(logits, -1)
    if pool > 1:
        attn = torch.nn.functional.max_pool1d(attn.reshape(-1, 1, t), pool, 1, pool // 2).view(b, h, t)
    saw = torch.tensor([min(observe, t - p) for p in range(t)], dtype=torch.float64)
    return attn, attn / saw


@pytest.mark.parametrize("form,cap,window", [
    ("mean", None, None), ("mean", 8, None), ("sum", None, None), ("mean", None, (4, 3)), ("sum", None, (4, 3)),
    ("mean", 6, (5, 4))])
@pytest.mark.parametrize("pool", [1, 3])
def test_the_first_eviction_after_a_prompt_aware_prefill_drops_what_the_selection_ranked_lowest(
        form, cap, window, pool):
    t, budget, recent, drop, observe, scaling = 40, 16, 3, 4, 5, 0.5
    gen = torch.Generator().manual_seed(11 + pool)
    q = torch.randn(2, 4, t + 1, 8, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(2, 2, t + 1, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, t + 1, 8, generator=gen, dtype=torch.float64)
    steps, buckets = window if window is not None else (None, 1)
    layer = CoreLayer(budget, recent, drop, ImportanceState(form, steps, buckets, mean_cap=cap),
                      Scissorhands(), prefill=PromptAware(observe, pool))
    layer.attend(q[:, :, :t], k[:, :, :t], v[:, :, :t], None, scaling)
    kept = [[layer.stored_positions(r)[hd].tolist() for hd in range(2)] for r in range(2)]
    layer.attend(q[:, :, t:], k[:, :, t:], v[:, :, t:], None, scaling)  # one decode step: evicts `drop` first
    observed, rate = naive_judgement(q[:, :, :t], k[:, :, :t], observe, pool, scaling)
    rank = rate if form == "mean" else observed
    for row in range(2):
        for head in range(2):
            slots = kept[row][head]
            assert len(slots) == budget
            old = slots[: budget - recent]  # the newest `recent` are shielded
            order = sorted(old, key=lambda p: (float(rank[row, head, p]), p))
            want = [p for p in slots if p not in set(order[:drop])] + [t]
            assert layer.stored_positions(row)[head].tolist() == want


@pytest.mark.parametrize("steps,buckets,now", [(4, 3, 0), (4, 3, 13), (5, 2, 29), (1, 6, 9), (3, 4, 11)])
def test_ring_steps_split_a_tokens_window_by_bucket(steps, buckets, now):
    """Each ring slot's count of the steps from a token's own to ``now`` inside the window (the naive count)."""
    positions = torch.arange(now + 1)[None, None]  # (1, 1, L)
    seen = torch.tensor([now + 1])
    counts = ring_steps(positions, seen, steps, buckets)  # (NB, 1, 1, L)
    start = max(0, (now // steps - buckets + 1) * steps)
    for p in range(now + 1):
        want = [0] * buckets
        for step in range(max(p, start), now + 1):
            want[(step // steps) % buckets] += 1
        assert counts[:, 0, 0, p].tolist() == want
        assert sum(want) == int(queries_in_window(positions, seen, steps, buckets)[0, 0, p])


def test_a_judged_rate_ranks_a_pooled_run_exactly_equal():
    """Slots the selection scored equal (a max-pooled run, each seen by a different number of queries) rank
    exactly equal after the judgement, so ties are broken by position alone, on any path."""
    for cap, window in ((None, None), (2048, None), (None, (16, 8)), (64, (16, 8))):
        steps, buckets = window if window is not None else (None, 1)
        state = ImportanceState("mean", steps, buckets, mean_cap=cap)
        t = 3000
        state.allocate(1, 1, t, group=1, device="cpu")
        positions = torch.arange(t)[None, None]
        seen = torch.tensor([t])
        observed = torch.full((1, 1, t), 0.1234567)  # one value everywhere: the rates tie
        watched = torch.minimum(seen - positions, torch.tensor(32)).float()
        state.judged(observed, watched, positions, seen)
        ranked = state.ranked(state.scores(t), positions, seen)[0, 0, : t - 32]  # those all 32 queries saw
        assert bool((ranked == ranked[0]).all()), (cap, window)
        torch.testing.assert_close(ranked[0], torch.tensor(0.1234567 / 32), rtol=2e-4, atol=0)  # 12 bits kept


def test_a_count_state_keeps_the_prompts_own_history():
    """``count`` cannot be made from summed probabilities: the judgement leaves it as the prompt's queries left it."""
    state = ImportanceState("count", None, 1)
    state.allocate(1, 2, 6, group=2, device="cpu")
    state.acc[..., :5] = torch.arange(10, dtype=state.acc.dtype).view(1, 1, 2, 5)
    before = state.acc.clone()
    positions = torch.arange(5).expand(1, 2, 5)
    state.judged(torch.rand(1, 2, 5), torch.ones(1, 2, 5), positions, torch.tensor([5]))
    assert torch.equal(state.acc, before)
