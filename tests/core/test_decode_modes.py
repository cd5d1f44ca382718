"""The static decode step (``decode="static"`` / ``"compiled"``): fixed shapes, no host sync, the same tokens kept.

Equality is checked in float64, against the naive reference and against the default (``dynamic``) step: the
static step attends over the same slots in another order, so in float32 its sums round differently (by about
1e-7), and a near-tie between two scores could then go either way. In float64 no such tie comes near.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_stream
from test_reference import cases, kept_of, make_inputs, run_layer
from torch.utils._python_dispatch import TorchDispatchMode

from scissorhands.core.layer.decode import static_step
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.tokens.protect import Protection

SYNCS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
         "aten.masked_select.default", "aten.unique_consecutive.default"}


@st.composite
def decode_cases(draw):
    """A case of the layer's reference test, fed as a prompt chunk and then one token at a time, with every
    importance form (the mean form included, capped or not)."""
    case = draw(cases())
    prompt = draw(st.integers(1, case["t"]))
    importance = draw(st.sampled_from(["sum", "count", "mean"]))
    mean_cap = draw(st.one_of(st.none(), st.integers(1, 12)))
    return dict(case, importance=importance, mean_cap=mean_cap, chunks=[prompt] + [1] * (case["t"] - prompt))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_cases())
def test_static_step_matches_the_reference(case):
    """A prompt chunk (streamed), then static decode steps: the reference's outputs and kept positions, and the
    layer never holds more than its budget."""
    q, k, v, valid = make_inputs(case)
    params = dict(budget=case["budget"], recent=case["recent"], drop=case["drop"], window=case["window"],
                  bucket_steps=case["bucket_steps"], importance=case["importance"], scaling=0.5,
                  mean_cap=case["mean_cap"])
    ref_out, ref_kept = reference_stream(q, k, v, valid, **params)
    out, layer = run_layer(q, k, v, valid, case["chunks"], query_tile=case["tile"], decode="static", **params)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert kept_of(layer, case["b"], case["h_kv"]) == ref_kept


@pytest.mark.parametrize("importance,window,bucket_steps", [("mean", None, None), ("sum", 8, 3), ("count", 6, None)])
def test_static_step_with_sinks_and_protected_spans(importance, window, bucket_steps):
    """Shields hold under the static step as under the reference; many evictions, recent tokens always kept."""
    case = dict(b=2, h_kv=2, group=2, t=70, seed=5, pads=[0, 0])
    q, k, v, valid = make_inputs(case)
    params = dict(budget=14, recent=3, drop=2, window=window, bucket_steps=bucket_steps, importance=importance,
                  scaling=0.5, sinks=2)
    spans = [[(10, 13)], [(30, 32), (40, 41)]]
    ref_out, ref_kept = reference_stream(q, k, v, valid, protect=spans, **params)
    out, layer = run_layer(q, k, v, valid, [9] + [1] * 61, decode="static", protect=Protection(spans), **params)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    kept = kept_of(layer, 2, 2)
    assert kept == ref_kept
    for row, row_spans in enumerate(spans):
        for h in range(2):
            assert set(range(2)) | {p for s, e in row_spans for p in range(s, e)} | set(range(67, 70)) <= set(
                kept[row][h])
    assert layer.kv.compressions > 10


def _count_ops(fn):
    names: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, names


def _buffers(b=2, h=2, c=12, d=8, nb=1, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, c, d, generator=gen, dtype=dtype)
    values = torch.randn(b, h, c, d, generator=gen, dtype=dtype)
    positions = torch.arange(c, dtype=torch.int32).expand(b, h, c).clone()
    acc = torch.rand(nb, b, h, c, generator=gen, dtype=torch.float32)
    seen = torch.full((b,), c, dtype=torch.long)
    return keys, values, positions, acc, seen


def test_static_step_reads_nothing_back_and_keeps_its_shapes():
    """No operator that synchronises with the host or makes a data-dependent shape, at an evicting step and at
    a step that does not evict; every buffer keeps its shape and storage."""
    keys, values, positions, acc, seen = _buffers()
    gen = torch.Generator().manual_seed(1)
    before = [(t.shape, t.data_ptr()) for t in (keys, values, positions, acc, seen)]
    evicting_steps = 0
    for step in range(6):
        q = torch.randn(2, 4, 1, 8, generator=gen, dtype=torch.float64)
        kv = [torch.randn(2, 2, 1, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
        full = bool(((positions >= 0).sum(-1) >= 12).all())
        evicting_steps += full
        _, names = _count_ops(lambda q=q, kv=kv: static_step(keys, values, positions, acc, seen, None, q, *kv,
                                                             budget=12, recent=3, drop=4, form="mean",
                                                             bucket_steps=None, scaling=0.5, softcap=None))
        assert not SYNCS & set(names), step
        assert [(t.shape, t.data_ptr()) for t in (keys, values, positions, acc, seen)] == before
    assert evicting_steps == 2  # the full cache evicts 4, fills them over 4 steps, then evicts again


def test_compiled_step_has_two_graphs_and_no_recompile_across_evictions():
    """``torch.compile(fullgraph=True)`` traces the step twice, once that cannot evict and once that may (the
    host knows which, from its lengths): after the first eviction, at least 3 more eviction events come and
    nothing recompiles. The outputs are the eager step's (float32; compiled kernels may fuse and reorder sums,
    so the tolerance is a float32 one), and the same slots are evicted and written."""
    torch._dynamo.reset()
    compiled = torch.compile(static_step, fullgraph=True, dynamic=False)
    eager_bufs = _buffers(dtype=torch.float32)
    comp_bufs = [t.clone() for t in eager_bufs]
    eager_bufs[2][:, :, 9:] = -1  # 9 of 12 slots stored: the first steps cannot evict
    comp_bufs[2][:, :, 9:] = -1
    gen = torch.Generator().manual_seed(2)
    kwargs = dict(budget=12, recent=3, drop=3, form="mean", bucket_steps=None, scaling=0.5, softcap=None)
    stored, events, both_compiled = 9, 0, False
    for _ in range(18):
        q = torch.randn(2, 4, 1, 8, generator=gen)
        k, v = torch.randn(2, 2, 1, 8, generator=gen), torch.randn(2, 2, 1, 8, generator=gen)
        evict = stored >= 12  # what the host knows, with no read of the device
        want = static_step(*eager_bufs, None, q, k, v, evict=evict, **kwargs)
        if both_compiled:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            got = compiled(*comp_bufs, None, q, k, v, evict=evict, **kwargs)
        finally:
            torch.compiler.set_stance("default")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(comp_bufs[2], eager_bufs[2])
        events += evict and both_compiled
        both_compiled = both_compiled or evict
        stored = stored - 3 * evict + 1
        assert int((eager_bufs[2] >= 0).sum(-1).max()) == stored
    assert events >= 3


@pytest.mark.parametrize("fields,match", [
    ({"decode": "static", "kv_bits": 4}, r"^decode: 'static' needs the dense store.*kv_bits=4"),
    ({"decode": "compiled", "merge": True}, r"^decode: 'compiled' needs the dense store.*merge=True"),
    ({"decode": "fast"}, r"^decode: "),
])
def test_static_decode_refuses_what_it_cannot_serve(fields, match):
    with pytest.raises(ValueError, match=match):
        CacheSettings(**fields)
