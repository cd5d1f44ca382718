"""Protected spans and the eviction audit against the naive reference (through real models:
tests/hf/test_protect_audit_cache.py)."""

import math

import pytest
from driver import CoreLayer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_stream
from test_reference import chunk_mask, make_inputs

from scissorhands.core.layer.audit import EvictionAudit
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import Protection


def run_protected(case, protect, audit):
    q, k, v, valid = make_inputs(case)
    window, steps = case["window"], case["bucket_steps"]
    n_buckets = 1 if window is None else math.ceil(window / (steps or 1))
    state = ImportanceState(case["importance"], None if window is None else (steps or 1), n_buckets, False)
    layer = CoreLayer(case["budget"], case["recent"], case["drop"], state, Scissorhands(),
                      query_tile=case["tile"], protect=Protection(protect))
    layer.kv.listeners.append(audit)
    audit.attach(0)
    i = 0
    for c in case["chunks"]:
        vc = valid[:, i:i + c]
        layer.attend(q[:, :, i:i + c], k[:, :, i:i + c], v[:, :, i:i + c], None if bool(vc.all()) else chunk_mask(vc),
                     0.5)
        assert int(layer.slots.lengths.max()) <= case["budget"]
        i += c
    return (q, k, v, valid), layer


@st.composite
def protected_cases(draw):
    b = draw(st.integers(1, 3))
    t = draw(st.integers(2, 40))
    recent = draw(st.integers(0, 4))
    budget = draw(st.integers(recent + 2, recent + 16))
    drop = draw(st.integers(1, budget - recent - 1))
    room = budget - recent - drop
    protect = []
    for _ in range(b):
        spans, used = [], 0
        for _ in range(draw(st.integers(0, 2))):
            start = draw(st.integers(0, t))
            length = draw(st.integers(1, max(1, room - used)))
            if used + length > room:
                break
            spans.append((start, start + length))
            used += length
        protect.append(spans)
    pads = [draw(st.integers(0, t - 1)) for _ in range(b)]
    cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=4))))
    window = draw(st.one_of(st.none(), st.integers(1, 10)))
    return dict(b=b, h_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])), t=t, recent=recent,
                budget=budget, drop=drop, window=window, bucket_steps=None,
                importance=draw(st.sampled_from(["sum", "count", "mean"])), pads=pads,
                chunks=[y - x for x, y in zip([0] + cuts, cuts + [t])], tile=draw(st.integers(1, 6)),
                seed=draw(st.integers(0, 2**16)), protect=protect)


def events_of(audit, layer=0):
    table = audit.event_table(layer)
    return sorted(zip(table["row"], table["head"], table["step"], table["position"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(protected_cases())
def test_protection_and_audit_match_the_reference(case):
    audit = EvictionAudit(events=True)
    (q, k, v, valid), layer = run_protected(case, case["protect"], audit)
    ref_events: list = []
    _, ref_kept = reference_stream(q, k, v, valid, budget=case["budget"], recent=case["recent"], drop=case["drop"],
                                   window=case["window"], bucket_steps=None, importance=case["importance"],
                                   scaling=0.5, protect=case["protect"], events=ref_events)
    kept = [[layer.stored_positions(b)[h].tolist() for h in range(case["h_kv"])] for b in range(case["b"])]
    assert kept == ref_kept
    # The audit saw exactly the reference's evictions: same rows, heads, steps and positions ...
    assert events_of(audit) == sorted((b, h, step, pos) for b, h, step, pos, _ in ref_events)
    # ... with the importance the selection used.
    table = audit.event_table(0)
    got = {(r, h, s, p): x for r, h, s, p, x in zip(table["row"], table["head"], table["step"], table["position"],
                                                   table["importance"])}
    for b, h, step, pos, score in ref_events:
        assert got[(b, h, step, pos)] == pytest.approx(score, rel=1e-6, abs=1e-9)
    # Protected positions that were seen are still held by every head.
    seen = valid.sum(dim=1).tolist()
    for b, spans in enumerate(case["protect"]):
        must = {p for lo, hi in spans for p in range(lo, min(hi, seen[b]))}
        for h in range(case["h_kv"]):
            assert must <= set(kept[b][h])
    # Counters agree with the events.
    assert int(audit.evicted[0].sum()) == len(ref_events) if ref_events else 0 not in audit.evicted
