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

from scissorhands.core.prefill import make_prefill
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.streaming import attend
from scissorhands.vllm import kernels
from scissorhands.vllm.paged import PagedLayer, Planner, block_views
from scissorhands.vllm.settings import parse

HQ, HKV, D, N = 4, 2, 8, 8  # query heads, KV heads, head size, block size (small, so windows cross blocks)
SCALE = D ** -0.5


class Blocks:
    """vLLM's side: one layer's paged cache, a block table and the requests' positions."""

    def __init__(self, requests: int, most: int, gen: torch.Generator):
        per = -(-most // N)
        self.cache = torch.zeros(requests * per, HKV, N, 2 * D)  # (num_blocks, H_kv, N, 2D)
        self.table = torch.randperm(requests * per, generator=gen).view(requests, per).to(torch.int32)

    def slots(self, row: int, positions: torch.Tensor) -> torch.Tensor:
        return self.table[row, positions // N].long() * N + positions % N

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        keys_t, values = block_views(self.cache)
        heads = torch.arange(HKV)[None, :]
        keys_t[(slots // N)[:, None], heads, :, (slots % N)[:, None]] = k  # (T, H_kv, D)
        values[(slots // N)[:, None], heads, (slots % N)[:, None], :] = v

    def window_output(self, row: int, q: torch.Tensor, p: int, budget: int) -> torch.Tensor:
        """vLLM's kernel for one decode query at position ``p``: attention over the logical slots ``(p - B, p]``."""
        keys_t, values = block_views(self.cache)
        where = self.slots(row, torch.arange(max(0, p - budget + 1), p + 1))
        k = keys_t[where // N, :, :, where % N]  # (L, H_kv, D)
        v = values[where // N, :, where % N, :]  # (L, H_kv, D)
        qg = q.view(HKV, HQ // HKV, D)  # (H_kv, g, D)
        probs = (torch.einsum("hgd,lhd->hgl", qg, k) * SCALE).softmax(-1)
        return torch.einsum("hgl,lhd->hgd", probs, v).reshape(HQ, D)

    def free_behind(self, row: int, p: int, budget: int) -> None:
        """What vLLM's sliding-window manager frees once position ``p`` is done: blocks wholly before ``p + 2 - B``."""
        for j in range(max(0, p + 2 - budget) // N):
            self.cache[self.table[row, j]] = float("nan")


def _alone(layer: PagedLayer):
    """A one-row core layer at the plugin's settings, as ``ScissorhandsCache`` builds it (rounds on)."""
    return layer._budgeted(DenseKVStore(), make_prefill(layer.settings.config), rounds=True)


@pytest.mark.parametrize("compiled", [True, False], ids=["operator", "reference"])
@pytest.mark.parametrize("plugin", [
    {"budget": 12},
    {"budget": 12, "drop": 4},
    {"budget": 12, "preset": "paper"},
    {"budget": 12, "method": "h2o", "recent": 2, "drop": 3},
    {"budget": 12, "method": "tova"},
    {"budget": 12, "method": "streaming", "drop": 2},
    {"budget": 11, "protect_prefix": 3, "recent": 2, "drop": 3},
    {"budget": 12, "importance": "count", "window": 6, "window_buckets": 3, "drop": 3},
], ids=["defaults", "drop4", "paper", "h2o", "tova", "streaming", "protected", "count-buckets"])
def test_each_request_keeps_what_the_core_keeps_and_the_window_attends_it(plugin, compiled):
    gen = torch.Generator().manual_seed(0)
    settings = parse(plugin)
    budget = settings.budget
    prompts = {"a": 30, "b": 9, "c": 21, "d": 17}  # "b" is shorter than the budget; "d" arrives later
    arrive = {"a": 0, "b": 0, "c": 0, "d": 5}
    steps = 26
    layer = PagedLayer(settings, 0, HQ, HKV, D, SCALE, None, compiled=compiled)
    planner = Planner(settings)
    blocks = Blocks(len(prompts), max(prompts.values()) + steps + 1, gen)
    rows = {rid: i for i, rid in enumerate(prompts)}  # the block-table row of each request
    alone: dict = {}
    seen = dict.fromkeys(prompts, 0)
    for step in range(steps):
        running = [rid for rid in prompts if arrive[rid] <= step]
        chunks = {rid: (prompts[rid] if seen[rid] == 0 else 1) for rid in running}
        t = sum(chunks.values())
        q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
        slots = torch.cat([blocks.slots(rows[rid], torch.arange(seen[rid], seen[rid] + chunks[rid]))
                           for rid in running])
        blocks.write(slots, k, v)
        starts = torch.tensor([0] + [chunks[rid] for rid in running]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([seen[rid] + chunks[rid] for rid in running], dtype=torch.int32)
        out = torch.zeros(t, HQ, D)
        for i, rid in enumerate(running):  # vLLM's kernel writes the decode rows' outputs
            if chunks[rid] == 1:
                out[starts[i]] = blocks.window_output(rows[rid], q[starts[i]], seen[rid], budget)
        table = blocks.table[[rows[r] for r in running]]
        plan = planner.for_step(step, running, starts, seq_lens, table, slots, N)
        assert planner.for_step(step, running, starts, seq_lens, table, slots, N) is plan  # one plan per step
        layer.step(plan, q, k, v, blocks.cache, out)
        for i, rid in enumerate(running):
            a, b = int(starts[i]), int(starts[i + 1])
            k4, v4 = k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None]  # (1, H_kv, T, D)
            if seen[rid] == 0:
                alone[rid] = _alone(layer)
                alone[rid].allocate(k4, v4)
            want = attend(alone[rid], q[a:b].transpose(0, 1)[None], k4, v4, None, SCALE, None,
                          settings.config.query_tile)  # (1, H_q, T, D)
            got = out[a:b]
            assert not torch.isnan(got).any(), f"{rid} step {step}: read a freed block"
            torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-6, rtol=1e-5)
            seen[rid] += b - a
            # The window holds what the core stores: the kept tokens and the victims still waiting to leave.
            mine = layer.stored_positions(blocks.table[rows[rid]], seen[rid]).tolist()
            ref = alone[rid].slots.row(0).sort(dim=-1).values.tolist()
            assert mine == ref, f"{rid} step {step}"
            assert len(mine[0]) <= budget
        for rid in running:
            blocks.free_behind(rows[rid], seen[rid] - 1, budget)
    assert layer.rounds > 0


@pytest.mark.parametrize("form", ["sum", "count"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_importance_update_equals_its_torch_reference(form, dtype):
    """The operator and the plain-torch update, on a random paged cache with ragged windows, restarts and GQA.
    float32 sums in another order: within 1e-5 (bfloat16 K are read as float32 by both)."""
    gen = torch.Generator().manual_seed(3)
    nb, n, budget = 40, 8, 19
    cache = torch.randn(nb, HKV, n, 2 * D, generator=gen).to(dtype)
    last = torch.tensor([0, 5, 18, 19, 37, 60])
    tables = torch.stack([torch.randperm(nb, generator=gen)[:8] for _ in last]).to(torch.int32)
    query = torch.randn(len(last) + 3, HQ, D, generator=gen)
    tok = torch.tensor([2, 0, 7, 1, 8, 3])
    bucket = torch.tensor([0, 1, 2, 0, 1, 2])
    restart = torch.tensor([True, False, False, True, False, True])
    acc = torch.rand(3, nb, HKV, n, generator=gen)
    a, b = acc.clone(), acc.clone()
    args = (query, cache, tok, last, tables, bucket, restart)
    kernels.observe(*args, a, budget, SCALE, None, form == "count")
    kernels.observe_reference(*args, b, budget, SCALE, None, form == "count")
    assert not torch.equal(a, acc)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
