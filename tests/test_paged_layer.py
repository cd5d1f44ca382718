"""The vLLM adapter's layer state (``scissorhands.vllm.paged``) on tensors laid out as vLLM's CPU blocks, offline.

No engine: this test plays vLLM's part. It writes each step's K/V into the blocks at the slots vLLM would, runs
``PagedLayer.step`` as the attention backend does, computes what vLLM's kernel computes for a decode query (the
window of the budget's last logical slots), and poisons with NaN every block vLLM would free behind the window,
so a read of a freed block shows. Each request is also fed, alone, through a one-row core layer
(``streaming.attend``, the path ``ScissorhandsCache`` takes): the window's output must equal the core's output,
and the positions each KV head keeps must equal the core's. The engine tests (tests/on_vllm) check the same on
vLLM itself; this one runs in every environment.
"""

from __future__ import annotations

import pytest
import torch

from scissorhands.core.prefill import make_prefill
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.streaming import attend
from scissorhands.vllm.paged import PagedLayer, block_views
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
    """A one-row core layer at the plugin's settings, as ``ScissorhandsCache`` builds it."""
    return layer._budgeted(DenseKVStore(), make_prefill(layer.settings.config))


@pytest.mark.parametrize("plugin", [
    {"budget": 12},
    {"budget": 12, "preset": "paper"},
    {"budget": 12, "method": "h2o", "recent": 2},
    {"budget": 12, "method": "tova"},
    {"budget": 11, "protect_prefix": 3, "recent": 2},
], ids=["defaults", "paper", "h2o", "tova", "protected"])
def test_each_request_keeps_what_the_core_keeps_and_the_window_attends_it(plugin):
    gen = torch.Generator().manual_seed(0)
    settings = parse(plugin)
    budget = settings.budget
    prompts = {"a": 30, "b": 9, "c": 21, "d": 17}  # "b" is shorter than the budget; "d" arrives later
    arrive = {"a": 0, "b": 0, "c": 0, "d": 5}
    steps = 22
    layer = PagedLayer(settings, 0, HQ, HKV, D, SCALE, None, rows=len(prompts))
    blocks = Blocks(len(prompts), max(prompts.values()) + steps + 1, gen)
    rows = {rid: i for i, rid in enumerate(prompts)}  # the block-table row of each request
    alone: dict = {}
    ahead: dict = {}  # per request: the plugin's kept positions when it dropped one ahead of the core
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
        layer.step(running, q, k, v, blocks.cache, starts, seq_lens, blocks.table[[rows[r] for r in running]],
                   slots, out)
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
            # A full row of the plugin drops, at the end of a step, the token the core drops at the start of the
            # next one (on the same scores): the core's set then equals the plugin's previous one and the new token.
            mine = layer.kv.slots.row(layer.row_of[rid]).sort(dim=-1).values.tolist()
            ref = alone[rid].slots.row(0).sort(dim=-1).values.tolist()
            if ahead.get(rid) is not None:
                assert ref == [sorted(h + [seen[rid] - 1]) for h in ahead[rid]], f"{rid} step {step}"
            if len(mine[0]) == len(ref[0]) - 1 == budget - 1:
                assert all(set(m) < set(r) for m, r in zip(mine, ref)), f"{rid} step {step}"
                ahead[rid] = mine
            else:
                assert mine == ref, f"{rid} step {step}"
                ahead[rid] = None
            assert len(mine[0]) <= budget
        for rid in running:
            blocks.free_behind(rows[rid], seen[rid] - 1, budget)


def test_the_row_pool_follows_the_sequences_that_run_not_max_num_seqs():
    """Rows cost importance state and per-step work: the pool starts at one row, doubles when a prompt finds none
    free, stops at ``rows`` (vLLM's max_num_seqs), and a released row is reused before the pool grows."""
    gen = torch.Generator().manual_seed(1)
    settings = parse({"budget": 12, "preset": "paper"})  # an exact 400-step window: 400 floats per slot and head
    layer = PagedLayer(settings, 0, HQ, HKV, D, SCALE, None, rows=6)
    blocks = Blocks(8, 40, gen)
    per_row = sum(s.nbytes() for s in layer.kv.states)

    def prompt(rid: str, row: int) -> None:  # one 20-token prompt in a step of its own
        q, k, v = (torch.randn(20, h, D, generator=gen) for h in (HQ, HKV, HKV))
        slots = blocks.slots(row, torch.arange(20))
        blocks.write(slots, k, v)
        layer.step([rid], q, k, v, blocks.cache, torch.tensor([0, 20], dtype=torch.int32),
                   torch.tensor([20], dtype=torch.int32), blocks.table[[row]], slots, torch.zeros(20, HQ, D))

    sizes = []
    for i in range(6):
        prompt(f"r{i}", i)
        sizes.append(layer.kv.slots.lengths.shape[0])
    assert sizes == [1, 2, 4, 4, 6, 6]
    assert sum(s.nbytes() for s in layer.kv.states) == 6 * per_row
    layer.release(["r2"])
    prompt("r6", 6)
    assert layer.row_of["r6"] == 2 and layer.kv.slots.lengths.shape[0] == 6
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        prompt("r7", 7)
