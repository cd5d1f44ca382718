"""The fast layer against the naive reference, over many configurations."""

import math

import pytest
import torch
from driver import CoreLayer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_stream

from scissorhands.core.attend.prefill import Streamed
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState


def chunk_mask(valid_chunk: torch.Tensor) -> torch.Tensor:
    """The model's mask for a chunk: causal and key padding, (B, 1, c, c), True = attend."""
    c = valid_chunk.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    return causal[None, None] & valid_chunk[:, None, None, :]


def run_layer(q, k, v, valid, chunks, *, budget, recent, drop, window, bucket_steps, importance, scaling,
              query_tile=256, sinks=0, value_weighted=False, prefill_drop=None, decode="dynamic", protect=None,
              rounds=False, mean_cap=None):
    """Feed the tensors through one budgeted layer (the core's driver, ``driver.CoreLayer``) in the given chunks."""
    n_buckets = 1 if window is None else math.ceil(window / (bucket_steps or 1))
    steps = None if window is None else (bucket_steps or 1)
    layer = CoreLayer(budget, recent, drop,
                      ImportanceState(importance, steps, n_buckets, value_weighted, mean_cap),
                      Scissorhands(), query_tile=query_tile, sinks=sinks, prefill=Streamed(prefill_drop),
                      decode=decode, protect=protect, rounds=rounds)
    outs, i = [], 0
    for c in chunks:
        vc = valid[:, i:i + c]
        mask = None if bool(vc.all()) else chunk_mask(vc)
        outs.append(layer.attend(q[:, :, i:i + c], k[:, :, i:i + c], v[:, :, i:i + c], mask, scaling))
        assert int(layer.slots.lengths.max()) <= budget
        assert layer.keys.shape[-2] <= budget
        i += c
    return torch.cat(outs, dim=2), layer


def kept_of(layer, b_size, h_kv):
    return [[layer.stored_positions(b)[h].tolist() for h in range(h_kv)] for b in range(b_size)]


@st.composite
def cases(draw):
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    t = draw(st.integers(1, 36))
    recent = draw(st.integers(0, 5))
    budget = draw(st.integers(recent + 1, recent + 20))
    drop = draw(st.integers(1, budget - recent))
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    bucket_steps = None if window is None else draw(st.one_of(st.none(), st.integers(1, 5)))
    importance = draw(st.sampled_from(["sum", "count"]))
    pads = [draw(st.integers(0, t - 1)) for _ in range(b)]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(t - 1, 1)), max_size=5))) - {t}) if t > 1 else []
    chunks = [y - x for x, y in zip([0] + cuts, cuts + [t])]
    tile = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    return dict(b=b, h_kv=h_kv, group=group, t=t, recent=recent, budget=budget, drop=drop, window=window,
                bucket_steps=bucket_steps, importance=importance, pads=pads, chunks=chunks, tile=tile, seed=seed)


def make_inputs(case, d=4):
    gen = torch.Generator().manual_seed(case["seed"])
    b, h_kv, t = case["b"], case["h_kv"], case["t"]
    # A spread of logit scales gives both peaked and flat attention.
    q = torch.randn(b, h_kv * case["group"], t, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(b, h_kv, t, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, t, d, generator=gen, dtype=torch.float64)
    valid = torch.ones(b, t, dtype=torch.bool)
    for row, p in enumerate(case["pads"]):
        valid[row, :p] = False
    return q, k, v, valid


def check_case(case):
    q, k, v, valid = make_inputs(case)
    params = dict(budget=case["budget"], recent=case["recent"], drop=case["drop"], window=case["window"],
                  bucket_steps=case["bucket_steps"], importance=case["importance"], scaling=0.5,
                  sinks=case.get("sinks", 0), value_weighted=case.get("value_weighted", False),
                  rounds=case.get("rounds", False), mean_cap=case.get("mean_cap"))
    ref_out, ref_kept = reference_stream(q, k, v, valid, **params)
    out, layer = run_layer(q, k, v, valid, case["chunks"], query_tile=case["tile"], **params)
    assert kept_of(layer, case["b"], case["h_kv"]) == ref_kept
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    # Padding queries produce zeros and store nothing.
    assert torch.all(out.transpose(1, 2)[~valid] == 0)
    assert layer.slots.lengths.tolist() == [min(len(ref_kept[r][0]), case["budget"]) for r in range(case["b"])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_layer_matches_reference(case):
    check_case(case)


@st.composite
def round_cases(draw):
    case = draw(cases())
    case["rounds"] = True
    return case


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(round_cases())
def test_rounds_match_the_reference(case):
    """Eviction in rounds (``rounds=True``): victims chosen ``drop`` at a time leave one per new token, oldest
    first, and are attended until they leave; outputs and kept positions equal the reference's rounds."""
    check_case(case)


def test_rounds_hold_the_budget_and_score_once_per_round():
    """A full layer in rounds stays at its budget, and evicts the same tokens the per-step semantics would only
    when a round is one token (drop 1)."""
    case = dict(b=1, h_kv=2, group=2, t=70, recent=3, budget=16, drop=5, window=None, bucket_steps=None,
                importance="sum", pads=[0], tile=8, seed=9)
    q, k, v, valid = make_inputs(case)
    params = dict(window=None, bucket_steps=None, importance="sum", scaling=0.5, budget=16, recent=3)
    calls = []
    _, rounds = run_layer(q, k, v, valid, [1] * 70, drop=5, rounds=True, **params)
    assert rounds.slots.lengths.tolist() == [16]
    assert rounds.kv.compressions == 70 - 16  # one token leaves per step once full
    orig = rounds.kv.method.score
    rounds.kv.method.score = lambda view: calls.append(1) or orig(view)
    for _ in range(10):  # ten more steps: two rounds of five
        x = torch.randn(1, 2, 1, 4, dtype=torch.float64)
        rounds.attend(torch.randn(1, 4, 1, 4, dtype=torch.float64), x, x, None, 0.5)
    assert len(calls) == 2
    one_a = run_layer(q, k, v, valid, [1] * 70, drop=1, rounds=True, **params)
    one_b = run_layer(q, k, v, valid, [1] * 70, drop=1, **params)
    torch.testing.assert_close(one_a[0], one_b[0], rtol=0, atol=0)
    assert kept_of(one_a[1], 1, 2) == kept_of(one_b[1], 1, 2)


@pytest.mark.parametrize("importance", ["sum", "count"])
@pytest.mark.parametrize("window,bucket_steps", [(None, None), (1, None), (6, None), (8, 3), (5, 5)])
def test_long_stream_matches_reference(importance, window, bucket_steps):
    """Many compressions, prefill larger than the budget, then decode steps."""
    case = dict(b=2, h_kv=2, group=3, t=60, recent=3, budget=12, drop=4, window=window,
                bucket_steps=bucket_steps, importance=importance, pads=[0, 9], chunks=[31] + [1] * 29,
                tile=5, seed=7)
    check_case(case)


def test_chunking_does_not_change_the_result():
    """One chunk, token by token, and odd chunks all give the same outputs and kept sets."""
    base = dict(b=2, h_kv=1, group=2, t=40, recent=2, budget=9, drop=3, window=7, bucket_steps=2,
                importance="sum", pads=[0, 5], tile=3, seed=3)
    q, k, v, valid = make_inputs(base)
    params = dict(budget=9, recent=2, drop=3, window=7, bucket_steps=2, importance="sum", scaling=0.5)
    results = [run_layer(q, k, v, valid, chunks, **params) for chunks in ([40], [1] * 40, [13, 1, 20, 6])]
    for out, layer in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-10, atol=1e-10)
        assert kept_of(layer, 2, 1) == kept_of(results[0][1], 2, 1)


@st.composite
def prefill_cases(draw):
    """A prompt as one chunk, then decode steps; the prompt's evictions drop ``prefill_drop`` tokens."""
    case = draw(cases())
    t = case["t"]
    prompt = draw(st.integers(1, t))
    case["chunks"] = [prompt] + [1] * (t - prompt)
    case["prefill_drop"] = draw(st.integers(1, case["budget"] - case["recent"]))
    return case


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefill_cases())
def test_a_separate_prefill_drop_matches_the_reference(case):
    """The fast path with ``prefill_drop`` against the naive reference with the same rule: outputs, kept
    positions, and the budget as a peak (checked in run_layer at every chunk)."""
    q, k, v, valid = make_inputs(case)
    params = dict(budget=case["budget"], recent=case["recent"], drop=case["drop"], window=case["window"],
                  bucket_steps=case["bucket_steps"], importance=case["importance"], scaling=0.5)
    ref_out, ref_kept = reference_stream(q, k, v, valid, **params, prefill=case["chunks"][0],
                                         prefill_drop=case["prefill_drop"])
    out, layer = run_layer(q, k, v, valid, case["chunks"], query_tile=case["tile"], prefill_drop=case["prefill_drop"],
                           **params)
    assert kept_of(layer, case["b"], case["h_kv"]) == ref_kept
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)


def test_prefill_drop_none_is_exact_streaming_and_a_larger_one_means_fewer_events():
    base = dict(b=1, h_kv=2, group=2, t=80, recent=2, budget=16, drop=2, window=None, bucket_steps=None,
                importance="sum", pads=[0], tile=8, seed=5)
    q, k, v, valid = make_inputs(base)
    params = dict(budget=16, recent=2, drop=2, window=None, bucket_steps=None, importance="sum", scaling=0.5)
    exact, one = run_layer(q, k, v, valid, [80], **params)
    same, two = run_layer(q, k, v, valid, [80], prefill_drop=2, **params)
    torch.testing.assert_close(same, exact, rtol=0, atol=0)
    _, big = run_layer(q, k, v, valid, [80], prefill_drop=8, **params)
    assert one.kv.compressions == 32 and big.kv.compressions == 8  # (80 - 16) / 2 against (80 - 16) / 8
    _, after = run_layer(q, k, v, valid, [60] + [1] * 20, prefill_drop=8, **params)
    # The prompt: 6 events of 8 leave 12 stored after 60 tokens; decode fills 4 free slots, then each of the
    # remaining 16 tokens' events drops 2 (the decode drop): 8 events.
    assert after.kv.compressions == 6 + 8


def test_recent_window_is_always_kept():
    case = dict(b=1, h_kv=2, group=1, t=50, recent=6, budget=10, drop=4, window=3, bucket_steps=None,
                importance="count", pads=[0], chunks=[1] * 50, tile=4, seed=11)
    q, k, v, valid = make_inputs(case)
    layer = CoreLayer(10, 6, 4, ImportanceState("count", 1, 3), Scissorhands())
    for t in range(50):
        layer.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], None, 0.5)
        for h in range(2):
            kept = set(layer.stored_positions(0)[h].tolist())
            assert set(range(max(0, t - 5), t + 1)) <= kept
            assert len(kept) <= 10


def test_ties_keep_the_more_recent_token():
    """All-zero queries give uniform attention: every older token ties, the oldest go first."""
    q = torch.zeros(1, 1, 20, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 20, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 20, 4, dtype=torch.float64)
    layer = CoreLayer(8, 2, 3, ImportanceState("count", None, 1), Scissorhands())
    for t in range(9):
        layer.attend(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], None, 1.0)
    # Uniform probabilities never exceed 1/n: all counts are 0, so the 3 oldest went.
    assert layer.stored_positions(0)[0].tolist() == [3, 4, 5, 6, 7, 8]


@st.composite
def aligned_round_cases(draw):
    """Rounds over unpadded rows with long chunks: a round's tokens go through one block (``Streamed._round_block``)."""
    case = draw(round_cases())
    case["pads"] = [0] * case["b"]
    case["t"] = t = draw(st.integers(case["budget"] + 1, case["budget"] + 40))
    cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=3))))
    case["chunks"] = [y - x for x, y in zip([0] + cuts, cuts + [t])]
    # Sinks where they leave a round its victims (the settings refuse a budget they fill).
    case["sinks"] = draw(st.sampled_from([0, 0, 2])) if case["budget"] - case["recent"] - 2 >= case["drop"] else 0
    return case


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(aligned_round_cases())
def test_a_rounds_block_matches_the_reference(case):
    """A round's tokens taken as one masked block (each victim hidden from the query at which it leaves on, all
    dropped when the block ends) give the reference's outputs and kept positions, token for token."""
    check_case(case)


def test_a_round_is_one_attention_computation(monkeypatch):
    """A full layer in rounds takes a chunk in one attention computation per round, not one per token: 60 tokens
    past a budget of 16 in rounds of 6 are 10 blocks (11 with the first block that fills the budget)."""
    import scissorhands.core.attend.blocks as blocks

    calls = []
    real = blocks.attend_stored
    monkeypatch.setattr(blocks, "attend_stored", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    case = dict(b=2, h_kv=2, group=2, t=76, recent=3, budget=16, drop=6, window=None, bucket_steps=None,
                importance="sum", pads=[0, 0], tile=128, seed=3)
    q, k, v, valid = make_inputs(case)
    out, layer = run_layer(q, k, v, valid, [76], budget=16, recent=3, drop=6, window=None, bucket_steps=None,
                           importance="sum", scaling=0.5, rounds=True)
    assert len(calls) == 11
    assert layer.kv.compressions == 76 - 16  # one event per token, as token by token
    ref_out, ref_kept = reference_stream(q, k, v, valid, budget=16, recent=3, drop=6, window=None,
                                         bucket_steps=None, importance="sum", scaling=0.5, rounds=True)
    assert kept_of(layer, 2, 2) == ref_kept
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)


def test_a_round_taken_token_by_token_keeps_the_peak_at_the_budget(monkeypatch):
    """``Streamed(block_rounds=False)`` (what a memory target's layers run): the same outputs and positions as the
    round's block, and no storage past the budget inside the chunk."""
    from scissorhands.core.layer.budgeted import BudgetedKV

    case = dict(b=1, h_kv=2, group=2, t=60, recent=3, budget=16, drop=6, window=None, bucket_steps=None,
                importance="sum", pads=[0], tile=128, seed=4)
    q, k, v, valid = make_inputs(case)
    grown = []
    resize = BudgetedKV.resize
    monkeypatch.setattr(BudgetedKV, "resize", lambda kv, capacity: grown.append(capacity) or resize(kv, capacity))
    outs = []
    for block in (True, False):
        layer = CoreLayer(16, 3, 6, ImportanceState("sum", None, 1), Scissorhands(),
                          prefill=Streamed(None, block_rounds=block), rounds=True)
        grown.clear()
        outs.append((layer.attend(q, k, v, None, 0.5), kept_of(layer, 1, 2), max(grown)))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-9, atol=1e-9)
    assert outs[0][1] == outs[1][1]
    assert outs[1][2] <= 16 < outs[0][2]
