"""The vLLM adapter's layer state (``scissorhands.vllm.paged``) on tensors laid out as vLLM's CPU blocks, offline.

No engine: this test plays vLLM's part. It writes each step's K/V into the blocks at the slots vLLM would, runs
``PagedLayer.step`` as the attention backend does, computes what vLLM's kernel computes for a decode query (the
window of the budget's last logical slots), and poisons with NaN every block vLLM would free behind the window,
so a read of a freed block shows. Each request is also fed, alone, through a one-row core layer in rounds
(``streaming.attend``, the path ``ScissorhandsCache`` takes with ``rounds=True``): the window's output must
equal the core's output, and the positions each KV head's window holds must equal the core's stored ones. The
engine tests (tests/on_vllm) check the same on vLLM itself; this one runs in every environment.
"""

from __future__ import annotations

import pytest
import torch

from scissorhands.core.attend.prefill import make_prefill
from scissorhands.core.attend.streaming import attend
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.tokens.protect import Protection
from scissorhands.vllm import kernels
from scissorhands.vllm.blocks import read_kv, write_kv
from scissorhands.vllm.paged import PagedLayer
from scissorhands.vllm.planner import Planner
from scissorhands.vllm.settings import parse

HQ, HKV, D, N = 4, 2, 16, 16  # query heads, KV heads, head size, block size (small, so windows cross blocks)
SCALE = D ** -0.5
FP8_SCALES = (0.5, 2.0)  # vLLM's k_scale, v_scale in the fp8 runs


class Blocks:
    """vLLM's side: one layer's paged cache, a block table and the requests' positions."""

    def __init__(self, requests: int, most: int, gen: torch.Generator, layout: str = "vec",
                 dtype: torch.dtype = torch.float32, fp8: str | None = None):
        per = -(-most // N)
        self.layout, self.fp8 = layout, fp8
        # (num_blocks, H_kv, N, 2D); vLLM's fp8 cache holds bytes
        self.cache = torch.zeros(requests * per, HKV, N, 2 * D, dtype=torch.uint8 if fp8 else dtype)
        self.table = torch.randperm(requests * per, generator=gen).view(requests, per).to(torch.int32)
        self.held: dict[int, int] = {}  # each row's held prompt (keep-prompt): its positions [0, P) stay

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        return self.table[row, positions // N].long() * N + positions % N

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        heads = torch.arange(HKV)[None, :]
        if self.fp8:  # vLLM's fp8 cache update: bytes, over the layer's scales
            k, v = kernels.quantize(k, self.fp8, FP8_SCALES[0]), kernels.quantize(v, self.fp8, FP8_SCALES[1])
        write_kv(self.cache, self.layout, (slots // N)[:, None], heads, (slots % N)[:, None], k, v)  # (T, H_kv, D)

    def window(self, row: int, p: int, budget: int) -> torch.Tensor:
        """The positions a decode query at ``p`` attends: what it holds ``[0, P)`` (a prompt, or a prefix), then
        ``[max(P, p-W+1), p]`` for a window of ``budget`` = W."""
        held = min(self.held.get(row, 0), p + 1)
        return torch.cat([torch.arange(held), torch.arange(max(held, p - budget + 1), p + 1)])

    def window_output(self, row: int, q: torch.Tensor, p: int, budget: int) -> torch.Tensor:
        """vLLM's kernel for one decode query at position ``p``: attention over the logical slots ``(p - B, p]``
        (and a held prompt's)."""
        where = self.slots(row, self.window(row, p, budget))[:, None]
        k, v = read_kv(self.cache, self.layout, where // N, torch.arange(HKV)[None, :], where % N)  # (L, H_kv, D)
        k, v = kernels.dequantize(k, self.fp8, FP8_SCALES[0]), kernels.dequantize(v, self.fp8, FP8_SCALES[1])
        qg = q.view(HKV, HQ // HKV, D)  # (H_kv, g, D)
        probs = (torch.einsum("hgd,lhd->hgl", qg, k) * SCALE).softmax(-1)
        return torch.einsum("hgl,lhd->hgd", probs, v).reshape(HQ, D)

    def free_behind(self, row: int, p: int, budget: int) -> None:
        """What vLLM's sliding-window manager frees once position ``p`` is done: blocks wholly before ``p + 2 - W``
        for a window of ``budget`` = W (holding a prompt or a prefix of P, the plugin's manager: those wholly between
        P's and that point)."""
        held = self.held.get(row, 0)
        for j in range(-(-held // N), max(0, p + 2 - budget) // N):
            self.cache[self.table[row, j]] = 0x7F if self.fp8 else float("nan")  # 0x7F: NaN in both fp8 formats


def _alone(layer: PagedLayer):
    """A one-row core layer at the plugin's settings, as ``ScissorhandsCache`` builds it (rounds on)."""
    return layer.budgeted(DenseKVStore(), make_prefill(layer.settings.config, layer.budget), rounds=True)


PLUGINS = {
    "defaults": {"budget": 12},
    "observe-8": {"budget": 12, "observe": 8},  # prompts longer than 8 + 1: their first queries take the fused head
    "drop4": {"budget": 12, "drop": 4},
    "paper": {"budget": 12, "preset": "paper"},
    "h2o": {"budget": 12, "method": "h2o", "recent": 2, "drop": 3},
    "tova": {"budget": 12, "method": "tova"},
    "rkv": {"budget": 12, "method": "rkv", "drop": 3},  # scores read the window's keys where they lie
    "streaming": {"budget": 12, "method": "streaming", "drop": 2},
    "protected": {"budget": 11, "protect_prefix": 3, "recent": 2, "drop": 3},
    "count-buckets": {"budget": 12, "importance": "count", "window": 6, "window_buckets": 3, "drop": 3},
    # The streamed prefill: prompts past the budget run rounds of their own and end with victims pending, at every
    # phase (prompts of 30, 21 and 17 against rounds of 1, 3, 4 and 5 from the token 12 on).
    "stream": {"budget": 12, "prefill": "stream"},
    "stream-drop3": {"budget": 12, "prefill": "stream", "drop": 3},
    "stream-drop4-prefill5": {"budget": 12, "prefill": "stream", "drop": 4, "prefill_drop": 5},
    "stream-h2o": {"budget": 12, "prefill": "stream", "method": "h2o", "recent": 2, "drop": 3},
    "stream-protected": {"budget": 11, "prefill": "stream", "protect_prefix": 3, "recent": 2, "drop": 3},
    # A held prefix past a whole block, longer than one prompt (9 tokens: its first generated tokens are held too).
    "protected-blocks": {"budget": 24, "protect_prefix": 18, "recent": 2, "drop": 2},
    "stream-protected-blocks": {"budget": 24, "prefill": "stream", "protect_prefix": 18, "recent": 2, "drop": 2},
    # The held prompt: each request's whole prompt stays beside a window of the budget that fills from its end.
    "keep-prompt": {"budget": 12, "prefill": "keep-prompt"},
    "keep-prompt-h2o": {"budget": 12, "prefill": "keep-prompt", "method": "h2o", "recent": 2, "drop": 3},
}


def _serve(plugin: dict, compiled: bool, layout: str = "vec", dtype: torch.dtype = torch.float32, check=None,
           fp8: str | None = None, stack: int = 1, defer: bool = False, spans: dict | None = None):
    """Four requests through ``stack`` layers as vLLM would step them; ``check(rid, step, layer, ...)`` after each
    step for the first layer, given the step's K/V as the cache holds them (``fp8``: a uint8 cache in that format,
    read back as float). Each layer has its own cache and inputs and the one block table. ``defer``: the layers'
    rounds wait for the planner's ``after_step``, which runs them all at once (the engine's path). ``spans``: each
    request's own protected spans, given to the planner as the worker gives a new request's.

    Returns the first layer, every step's outputs (of every layer, stacked when ``stack > 1``) and the layers."""
    gen = torch.Generator().manual_seed(0)
    settings = parse(plugin)
    budget = settings.window  # the slots after what a request holds
    prompts = {"a": 30, "b": 9, "c": 21, "d": 17}  # "b" is shorter than the budget; "d" arrives later
    arrive = {"a": 0, "b": 0, "c": 0, "d": 5}
    steps = 26
    layers = [PagedLayer(settings, i, HQ, HKV, D, SCALE, None, compiled=compiled, layout=layout, fp8=fp8,
                         **dict(zip(("k_scale", "v_scale"), FP8_SCALES) if fp8 else ())) for i in range(stack)]
    for layer in layers:
        layer.defer_rounds = defer
    planner = Planner(settings)
    caches = [Blocks(len(prompts), max(prompts.values()) + steps + 1, gen, layout, dtype, fp8) for _ in layers]
    for other in caches[1:]:
        other.table = caches[0].table  # one block table for every layer, as in vLLM
    blocks = caches[0]
    rows = {rid: i for i, rid in enumerate(prompts)}  # the block-table row of each request
    seen = dict.fromkeys(prompts, 0)
    outputs = []
    for step in range(steps):
        running = [rid for rid in prompts if arrive[rid] <= step]
        chunks = {rid: (prompts[rid] if seen[rid] == 0 else 1) for rid in running}
        new = [rid for rid in running if seen[rid] == 0]
        planner.begin(new, {rid: spans[rid] for rid in new if spans and rid in spans})
        t = sum(chunks.values())
        slots = torch.cat([blocks.slots(rows[rid], torch.arange(seen[rid], seen[rid] + chunks[rid]))
                           for rid in running])
        starts = torch.tensor([0] + [chunks[rid] for rid in running]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([seen[rid] + chunks[rid] for rid in running], dtype=torch.int32)
        table = blocks.table[[rows[r] for r in running]]
        plan = planner.for_step(step, running, starts, seq_lens, table, slots, N)
        assert planner.for_step(step, running, starts, seq_lens, table, slots, N) is plan  # one plan per step
        for other in caches:
            other.held = {rows[rid]: planner.held.get(rid, 0) for rid in running}
        outs, inputs = [], []
        for layer, cache in zip(layers, caches):
            q, k, v = (torch.randn(t, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
            cache.write(slots, k, v)  # vLLM's cache update, before the layer runs
            out = torch.full((t, HQ, D), float("nan"), dtype=dtype)  # the layer writes every row
            layer.step(plan, q, k, v, cache.cache, out)
            outs.append(out)
            inputs.append((q, k, v))
        planner.after_step(step, layers)
        outputs.append(outs[0] if stack == 1 else torch.stack(outs))
        q, k, v = inputs[0]
        held = (k, v) if not fp8 else tuple(kernels.dequantize(kernels.quantize(x, fp8, sc), fp8, sc)
                                            for x, sc in zip((k, v), FP8_SCALES))
        for i, rid in enumerate(running):
            a, b = int(starts[i]), int(starts[i + 1])
            for out in outs:
                assert not torch.isnan(out[a:b]).any(), \
                    f"{rid} step {step}: a row left unwritten, or a freed block read"
            if check is not None:
                check(rid, step, layers[0], blocks, rows[rid], seen[rid], q[a:b], held[0][a:b], held[1][a:b],
                      outs[0][a:b])
            seen[rid] += b - a
            for layer in layers:
                kept = planner.held.get(rid, 0)
                assert layer.stored_positions(blocks.table[rows[rid]], seen[rid], kept).shape[-1] <= budget + kept
        for rid in running:
            for cache in caches:
                cache.free_behind(rows[rid], seen[rid] - 1, budget)
    assert all(layer.rounds > 0 for layer in layers)
    return layers[0], outputs, layers


HELD = {  # (settings, prompt length): what a request holds where vLLM wrote it, and so may share
    "keep-prompt": ({"budget": 12, "prefill": "keep-prompt", "drop": 3}, 37),
    # A protected prefix of 33 beside a window of 11: the prompt of 57 is judged by its last 4 queries.
    "prefix": ({"budget": 44, "protect_prefix": 33, "observe": 4, "recent": 2, "drop": 3}, 57),
    "stream-prefix": ({"budget": 44, "prefill": "stream", "protect_prefix": 33, "recent": 2, "drop": 3}, 57),
}


@pytest.mark.parametrize("compiled", [True, False], ids=["operator", "reference"])
@pytest.mark.parametrize("cached", [16, 32])
@pytest.mark.parametrize("held", list(HELD))
def test_a_sequence_begun_from_vllms_prefix_cache_serves_what_its_whole_prefill_serves(held, cached, compiled):
    """A held prompt (``prefill="keep-prompt"``) or a held prefix (``protect_prefix``) with vLLM's prefix cache: a
    request whose first ``cached`` tokens are in cached blocks computes only the rest. Its outputs for those
    tokens, the positions its window holds and every decode step after (through the rounds) equal those of the
    same request prefilled whole."""
    given, prompt = HELD[held]
    settings = parse(given)
    steps = 24
    runs = []
    for hit in (0, cached):
        torch.manual_seed(0)
        blocks = Blocks(1, prompt + steps + 1, torch.Generator().manual_seed(1))
        layer = PagedLayer(settings, 0, HQ, HKV, D, SCALE, None, compiled=compiled)
        planner = Planner(settings)
        g = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(prompt, h, D, generator=g) for h in (HQ, HKV, HKV))
        blocks.write(blocks.slots(0, torch.arange(prompt)), k, v)  # the cached part by an earlier request
        planner.begin(["a"])
        slots = blocks.slots(0, torch.arange(hit, prompt))
        plan = planner.for_step(0, ["a"], torch.tensor([0, prompt - hit], dtype=torch.int32),
                                torch.tensor([prompt], dtype=torch.int32), blocks.table, slots, N)
        kept = planner.held["a"]
        assert kept == (prompt if held == "keep-prompt" else given["protect_prefix"]) >= cached
        assert plan.prefills == [(0, 0, prompt - hit, kept, hit)] and planner.reused == hit
        out = torch.full((prompt - hit, HQ, D), float("nan"))
        layer.step(plan, q[hit:], k[hit:], v[hit:], blocks.cache, out)
        outs, stored = [out[cached - hit:]], [layer.stored_positions(blocks.table[0], prompt, kept).tolist()]
        for step in range(1, steps + 1):
            seen = prompt + step - 1
            planner.begin([])
            q1, k1, v1 = (torch.randn(1, h, D, generator=g) for h in (HQ, HKV, HKV))
            slot = blocks.slots(0, torch.tensor([seen]))
            blocks.write(slot, k1, v1)
            plan = planner.for_step(step, ["a"], torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([seen + 1], dtype=torch.int32), blocks.table, slot, N)
            out = torch.full((1, HQ, D), float("nan"))
            layer.step(plan, q1, k1, v1, blocks.cache, out)
            outs.append(out)
            stored.append(layer.stored_positions(blocks.table[0], seen + 1, kept).tolist())
        assert layer.rounds > 0  # the window after what the request holds has run its rounds
        runs.append((outs, stored))
    (want, want_kept), (got, got_kept) = runs
    assert got_kept == want_kept
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


def _like_the_core(settings, atol: float = 2e-6, spans: dict | None = None):
    """A ``check`` for :func:`_serve`: each request's step output equals a one-row core layer in rounds fed that
    request alone (given its ``spans`` as ``protect=``), and its window holds what the core stores (the kept
    tokens and the victims still waiting to leave). Returns the window's positions per KV head."""
    alone: dict = {}

    def check(rid, step, layer, blocks, row, seen, q, k, v, got) -> list:
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H_kv, T, D)
        if seen == 0:
            alone[rid] = _alone(layer)
            if spans and rid in spans:
                alone[rid].given_shields.append(Protection([spans[rid]]))
            alone[rid].allocate(k4, v4)
        want = attend(alone[rid], q.transpose(0, 1)[None], k4, v4, None, SCALE, None,
                      settings.config.query_tile)  # (1, H_q, T, D)
        torch.testing.assert_close(got, want[0].transpose(0, 1), atol=atol, rtol=1e-5)
        mine = layer.stored_positions(blocks.table[row], seen + q.shape[0], blocks.held.get(row, 0)).tolist()
        assert mine == alone[rid].slots.row(0).sort(dim=-1).values.tolist(), f"{rid} step {step}"
        return mine

    return check


@pytest.mark.parametrize("compiled", [True, False], ids=["operator", "reference"])
@pytest.mark.parametrize("name", list(PLUGINS))
def test_each_request_keeps_what_the_core_keeps_and_the_window_attends_it(name, compiled):
    """Each request's window output equals a one-row core layer in rounds fed that request alone, and equals what
    vLLM's kernel computes over the window's slots; the window holds the core's stored positions. With the
    operator, prompts longer than the budget are attended and scored in one pass by the compiled prompt operator
    (``_hold_fused``); with the reference, by the core's own tiled pass: both must keep what the core keeps."""
    settings = parse(PLUGINS[name])
    like_the_core = _like_the_core(settings)

    def check(rid, step, layer, blocks, row, seen, q, k, v, got):
        like_the_core(rid, step, layer, blocks, row, seen, q, k, v, got)
        if q.shape[0] == 1:  # a decode row: vLLM's own kernel over the window would give the same
            torch.testing.assert_close(got[0], blocks.window_output(row, q[0], seen, settings.window), atol=2e-6,
                                       rtol=1e-5)

    layer, _, _ = _serve(PLUGINS[name], compiled, check=check)
    # The operator's run attends long prompts the fused way (the prompt-aware prefill's; a streamed one the core's).
    assert (layer.prompts_fused > 0) == (compiled and settings.config.prefill == "prompt-aware")
    # A held prompt is attended in one fused call on both paths (nothing of it is evicted or judged): the core's
    # outputs and positions all the same.
    assert layer.prompts_held_whole == (4 if settings.config.prefill == "keep-prompt" else 0)
    # With 8 observed queries, the first queries of the prompts of 30, 21 and 17 go through torch's fused attention
    # (of the states here, only a count reads their probabilities).
    counted = settings.config.importance == "count"
    assert layer.head_queries_fused == (22 + 13 + 9 if compiled and name == "observe-8" and not counted else 0)


SPANS = {"a": [(5, 7), (20, 21)], "c": [(2, 4)], "d": [(10, 12)]}  # each request's own ("b" none)


@pytest.mark.parametrize("compiled", [True, False], ids=["operator", "reference"])
@pytest.mark.parametrize("name", ["defaults", "h2o", "stream-drop3", "protected", "stream-protected"])
def test_a_requests_own_protected_spans_keep_what_the_core_keeps_under_protect(name, compiled):
    """Each request's own protected spans (a request's ``extra_args``, through the planner): its window output and
    stored positions equal a one-row core layer given the same spans as ``protect=``, at every step, and every
    span stays in every KV head's window."""
    like_the_core = _like_the_core(parse(PLUGINS[name]), spans=SPANS)

    def check(rid, step, layer, blocks, row, seen, q, k, v, got):
        mine = like_the_core(rid, step, layer, blocks, row, seen, q, k, v, got)
        for a, b in SPANS.get(rid, []):
            if b <= seen + q.shape[0]:
                assert all(set(range(a, b)) <= set(head) for head in mine), f"{rid} step {step}"

    layer, _, _ = _serve(PLUGINS[name], compiled, check=check, spans=SPANS, stack=2, defer=True)
    assert layer.rounds > 0


@pytest.mark.parametrize("name", ["defaults", "h2o", "count-buckets"])
def test_vllm_amx_layout_serves_what_the_vec_layout_serves(name):
    """bf16 K/V in vLLM's AMX tiles (what vLLM picks for bf16 on CPUs with AMX) against the same K/V in the vec
    layout: the same outputs and the same kept positions at every step. The layouts differ only in where each
    element lies; the operator reads them in another order, so outputs agree to float32 rounding, not bitwise."""
    kept: dict = {}

    def check(layout):
        def record(rid, step, layer, blocks, row, seen, q, k, v, got):
            kept[layout, rid, step] = layer.stored_positions(blocks.table[row], seen + q.shape[0]).tolist()
        return record

    _, vec, _ = _serve(PLUGINS[name], True, "vec", torch.bfloat16, check("vec"))
    layer, amx, _ = _serve(PLUGINS[name], True, "amx", torch.bfloat16, check("amx"))
    for a, b in zip(vec, amx):
        torch.testing.assert_close(b.float(), a.float(), atol=1e-2, rtol=1e-2)  # bf16 outputs: one ulp apart
    assert [v for (lay, *_), v in kept.items() if lay == "amx"] == [v for (lay, *_), v in kept.items() if lay == "vec"]
    assert layer.layout == "amx" and layer.rounds > 0


@pytest.mark.parametrize("fp8", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("name", ["defaults", "h2o", "count-buckets"])
def test_vllms_fp8_cache_keeps_what_the_core_keeps_on_the_8_bit_values(name, fp8):
    """Eviction over vLLM's fp8 K/V (a uint8 cache, scales 0.5 and 2): the prompt is attended and kept as the
    cache holds it (read back from its 8-bit slots), decode rows read the bytes; a one-row core layer fed the
    same 8-bit values must give the same outputs and keep the same positions, step by step."""
    layer, _, _ = _serve(PLUGINS[name], True, check=_like_the_core(parse(PLUGINS[name]), atol=2e-5), fp8=fp8)
    assert layer.prompts_fused > 0


def test_the_amx_layout_is_vllms():
    """The AMX views put each element where vLLM's AMX cache update writes it: K at
    (o // 16) * 16D + (d // 2) * 32 + (o % 16) * 2 + d % 2, V at N*D + (d // 16) * 16N + (o // 2) * 32 + (d % 16) * 2
    + o % 2, from the start of a (block, KV head) region (vLLM's csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache)."""
    nb, h, n, d = 3, 2, 32, 32
    cache = torch.zeros(nb, h, n, 2 * d, dtype=torch.bfloat16)
    k = torch.arange(nb * h * n * d, dtype=torch.float32).view(nb, h, n, d) % 251
    v = k.flip(-1)
    blk, head, off = (torch.arange(nb)[:, None, None], torch.arange(h)[None, :, None], torch.arange(n)[None, None, :])
    write_kv(cache, "amx", blk, head, off, k, v)
    flat = cache.view(nb, h, 2 * n * d).float()
    for b, hh, o, dd in [(0, 0, 0, 0), (1, 1, 17, 5), (2, 0, 31, 31), (2, 1, 3, 18)]:
        assert flat[b, hh, (o // 16) * 16 * d + (dd // 2) * 32 + (o % 16) * 2 + dd % 2] == k[b, hh, o, dd]
        assert flat[b, hh, n * d + (dd // 16) * 16 * n + (o // 2) * 32 + (dd % 16) * 2 + o % 2] == v[b, hh, o, dd]
    rk, rv = read_kv(cache, "amx", blk, head, off)
    assert torch.equal(rk.float(), k) and torch.equal(rv.float(), v)
    ks, vs = kernels.keys_values(cache, "amx")
    assert torch.equal(ks, k) and torch.equal(vs, v)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("form", ["sum", "count", "none"])
@pytest.mark.parametrize("layout,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16),
                                          ("vec", "fp8"), ("vec", "fp8_e5m2"), ("amx", "fp8_e4m3")],
                         ids=["vec-float32", "vec-bf16", "amx-bf16", "vec-fp8", "vec-fp8_e5m2", "amx-fp8_e4m3"])
def test_the_compiled_decode_step_equals_its_torch_reference(layout, dtype, form, softcap):
    """The operator and the plain-torch step, on a random paged cache with ragged windows, restarts and GQA:
    outputs and the importance update ("none": a method with no importance, outputs only). float32 sums in
    another order (and the operator's vectorised exponential): within 1e-5; bfloat16 K/V are read as float32 by
    both, and vLLM's fp8 bytes (a uint8 cache) through torch's own fp8 types on the reference's side, with
    scales that are not 1."""
    gen = torch.Generator().manual_seed(3)
    nb, n, budget = 40, 16, 19
    fp8 = dtype if isinstance(dtype, str) else None
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    cache = torch.randn(nb, HKV, n, 2 * D, generator=gen)
    cache = kernels.quantize(cache, fp8, 0.5) if fp8 else cache.to(dtype)  # either scale: K and V alike here
    last = torch.tensor([0, 5, 18, 19, 37, 60, 100])
    tables = torch.stack([torch.randperm(nb, generator=gen)[:8] for _ in last]).to(torch.int32)
    query = torch.randn(len(last) + 3, HQ, D, generator=gen)
    tok = torch.tensor([2, 0, 7, 1, 8, 3, 9])
    bucket = torch.tensor([0, 1, 2, 0, 1, 2, 1])
    restart = torch.tensor([True, False, False, True, False, True, False])
    acc = torch.rand(3, nb, HKV, n, generator=gen)
    a, b = (None, None) if form == "none" else (acc.clone(), acc.clone())
    out_a, out_b = torch.zeros(len(last), HQ, D), torch.zeros(len(last), HQ, D)
    args = (query, cache, tok, last, tables, bucket, restart)
    kernels.decode(*args, a, out_a, budget, SCALE, softcap, form == "count", layout, fp8, **scales)
    kernels.decode_reference(*args, b, out_b, budget, SCALE, softcap, form == "count", layout, fp8, **scales)
    assert out_a.abs().sum() > 0
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)
    if a is not None:
        assert not torch.equal(a, acc)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("form,bucket_steps",
                         [("sum", None), ("count", None), ("sum", 5), ("count", 7), ("none", None)],
                         ids=["sum", "count", "sum-buckets", "count-buckets", "none"])
@pytest.mark.parametrize("t", [1, 16, 45])
def test_the_compiled_prompt_pass_equals_its_torch_reference(t, form, bucket_steps, softcap):
    """The one-pass prompt operator against the whole causal softmax in float64: outputs, the importance each
    bucket holds after every query (restarted buckets keep only their latest queries) and the last queries'
    snapshot; tiles of 16 queries so prompts cross tiles, and GQA. float32 products and sums in another order:
    within 1e-5 (probabilities, and counts, which are whole numbers, exactly where no probability sits within
    float32 rounding of its threshold: none does on these seeded inputs)."""
    gen = torch.Generator().manual_seed(t)
    g = HQ // HKV
    q = torch.randn(HKV, g, t, D, generator=gen)
    k, v = torch.randn(HKV, t, D, generator=gen), torch.randn(HKV, t, D, generator=gen)
    n_buckets = 3 if bucket_steps else 1
    acc = None if form == "none" else [torch.full((n_buckets, HKV, t), 7.0) for _ in range(2)]
    snaps = [torch.full((HKV, t), 7.0) for _ in range(2)]
    outs = [torch.full((t, HQ, D), float("nan")) for _ in range(2)]
    observe_from = max(0, t - 6)
    for i, run in enumerate((kernels.prompt, kernels.prompt_reference)):
        run(q, k, v, outs[i], None if acc is None else acc[i], snaps[i], SCALE, softcap, form == "count",
            bucket_steps, observe_from, tile=16)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(snaps[0], snaps[1], atol=1e-5, rtol=1e-5)
    assert snaps[0].sum(-1).allclose(torch.full((HKV,), float(g * (t - observe_from))))  # rows sum to 1
    if acc is not None:
        torch.testing.assert_close(acc[0], acc[1], atol=1e-5, rtol=1e-5)
        assert not torch.equal(acc[0], torch.full_like(acc[0], 7.0))


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("t,given", [(45, 6), (45, 20), (45, 45), (7, 1)])
def test_the_prompt_pass_over_its_last_queries_equals_the_whole_pass_there(t, given, softcap):
    """Given only the prompt's last ``given`` queries (the plugin attends the others by torch's fused attention),
    the operator and its reference give those queries' rows of the whole pass, and the same snapshot: the queries
    sit at their positions in the prompt, each seeing the keys up to its own."""
    gen = torch.Generator().manual_seed(given)
    g = HQ // HKV
    q = torch.randn(HKV, g, t, D, generator=gen)
    k, v = torch.randn(HKV, t, D, generator=gen), torch.randn(HKV, t, D, generator=gen)
    observe_from = t - given
    whole, whole_snap = torch.empty(t, HQ, D), torch.empty(HKV, t)
    kernels.prompt_reference(q, k, v, whole, None, whole_snap, SCALE, softcap, False, None, observe_from, tile=16)
    for run in (kernels.prompt, kernels.prompt_reference):
        out, snap = torch.full((given, HQ, D), float("nan")), torch.full((HKV, t), 7.0)
        run(q[:, :, observe_from:].contiguous(), k, v, out, None, snap, SCALE, softcap, False, None, observe_from,
            tile=16)
        torch.testing.assert_close(out, whole[observe_from:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(snap, whole_snap, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="acc: every query"):  # an importance needs every query's shares
        kernels.prompt(q[:, :, 1:].contiguous(), k, v, torch.empty(t - 1, HQ, D), torch.empty(1, HKV, t), None,
                       SCALE, softcap, False, None, 0)



STACKED = {**PLUGINS, "random": {"budget": 12, "method": "random", "drop": 3},
           "value-weighted": {"budget": 12, "value_weighted": True, "drop": 3}}


@pytest.mark.parametrize("layout,dtype", [("vec", torch.float32), ("amx", torch.bfloat16)])
@pytest.mark.parametrize("name", list(STACKED))
def test_every_layers_rounds_at_once_equal_each_layers_own(name, layout, dtype):
    """The engine's path runs a step's rounds for all layers in one batch after the forward (``Planner.after_step``
    over positions and importance stacked across layers); each layer rounding alone inside its own step is the
    reference. Three layers with their own caches and inputs: every step's outputs, every layer's kept positions,
    importance and K/V must be equal, bit for bit (the batch reorders no float sum). "random" scores by layer
    index, so it takes the per-layer scoring branch; "value-weighted" reads each layer's own values."""
    _, alone, layers_alone = _serve(STACKED[name], True, layout, dtype, stack=3)
    _, batch, layers_batch = _serve(STACKED[name], True, layout, dtype, stack=3, defer=True)
    for a, b in zip(alone, batch):
        assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    for one, other in zip(layers_alone, layers_batch):
        assert one.rounds == other.rounds > 0
        assert torch.equal(one.pos, other.pos)
        assert (one.acc is None) == (other.acc is None)
        if one.acc is not None:
            assert torch.equal(one.acc, other.acc)
        assert torch.equal(one.kv_cache.view(torch.uint8), other.kv_cache.view(torch.uint8))  # NaN-poisoned blocks too
    assert layers_batch[0].pos._base is layers_batch[1].pos._base is not None  # the batch ran on the stacked tensors
