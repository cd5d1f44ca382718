"""Time the vLLM adapter's per-layer bookkeeping on its own: ``PagedLayer.step`` over tensors laid out as
vLLM's CPU blocks, without an engine (so it runs in the project's own environment).

R requests with prompts of P to P + R - 1 tokens (so their rounds fall on different steps, as in serving) are
prefilled in one step, then decoded for S steps, one token each; each step writes the new tokens' K/V where
vLLM would (``slot_mapping``) before the layer runs, as vLLM's cache update does. What is timed is the plugin's
work: the step's plan (once per step for every layer) and one layer's step (the decode attention with its
importance update, which replaces vLLM's kernel call, and the rounds with their moves when a request starts
one). Medians over the steps after a warm-up.

    python experiments/vllm_paged_step.py --requests 32 --prompt 700 --budget 140 --steps 40 --out OUT.json

Before and after a change, run it on both checkouts in turn (``PYTHONPATH=OLD/src python ...``) and compare
the medians of runs made one after the other.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from scissorhands.vllm.blocks import write_kv
from scissorhands.vllm.paged import PagedLayer
from scissorhands.vllm.planner import Planner
from scissorhands.vllm.settings import parse

HEADS, KV_HEADS, HEAD = 9, 3, 64  # SmolLM2-135M's attention shape
BLOCK = 128  # vLLM's CPU block size


class Harness:
    """One layer, R requests, the blocks they use and the steps vLLM would run."""

    def __init__(self, requests: int, prompt: int, budget: int, steps: int, method: str, drop=None,
                 compiled: bool = True, seed: int = 0):
        self.requests, self.prompt, self.steps = requests, prompt, steps
        plugin = {"budget": budget, "method": method} | ({} if drop is None else {"drop": drop})
        settings = parse(plugin)
        self.layer = PagedLayer(settings, 0, HEADS, KV_HEADS, HEAD, HEAD ** -0.5, None, compiled=compiled)
        self.planner = Planner(settings)
        self.plan_s: list[float] = []
        self.step_s: list[float] = []
        self.lengths = [prompt + i for i in range(requests)]
        per = math.ceil((prompt + requests + steps + 1) / BLOCK)
        self.table = torch.arange(requests * per, dtype=torch.int32).view(requests, per)  # (R, blocks)
        self.cache = torch.zeros(requests * per, KV_HEADS, BLOCK, 2 * HEAD)  # (num_blocks, H_kv, N, 2D)
        self.gen = torch.Generator().manual_seed(seed)
        self.ids = [f"r{i}" for i in range(requests)]

    def _slots(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.table[rows, positions // BLOCK].long() * BLOCK + positions % BLOCK

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        heads = torch.arange(KV_HEADS)[None, :]
        write_kv(self.cache, "vec", (slots // BLOCK)[:, None], heads, (slots % BLOCK)[:, None], k, v)

    def _run(self, positions: torch.Tensor, rows: torch.Tensor, counts: list[int], seq_lens: list[int]) -> None:
        t = positions.shape[0]
        q = torch.randn(t, HEADS, HEAD, generator=self.gen)
        k = torch.randn(t, KV_HEADS, HEAD, generator=self.gen)
        v = torch.randn(t, KV_HEADS, HEAD, generator=self.gen)
        slots = self._slots(positions, rows)
        self._write(slots, k, v)
        start = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
        out = torch.zeros(t, HEADS, HEAD)
        t0 = time.perf_counter()
        plan = self.planner.plan(self.ids, start, torch.tensor(seq_lens, dtype=torch.int32), self.table, slots, BLOCK)
        self.plan_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.layer.step(plan, q, k, v, self.cache, out)
        self.step_s.append(time.perf_counter() - t0)

    def prefill(self) -> None:
        positions = torch.cat([torch.arange(n) for n in self.lengths])
        rows = torch.cat([torch.full((n,), i) for i, n in enumerate(self.lengths)])
        self._run(positions, rows, list(self.lengths), list(self.lengths))

    def decode(self, step: int) -> None:
        p = torch.tensor(self.lengths) + step
        self._run(p, torch.arange(self.requests), [1] * self.requests, (p + 1).tolist())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--budget", type=int, default=140)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--method", default="scissorhands")
    ap.add_argument("--drop", default=None, help="the drop amount (a fraction of the budget, or a count)")
    ap.add_argument("--reference", action="store_true", help="the torch reference instead of the compiled operator")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    drop = None if args.drop is None else (float(args.drop) if "." in args.drop else int(args.drop))
    h = Harness(args.requests, args.prompt, args.budget, args.steps + args.warmup, args.method, drop,
                not args.reference)
    h.prefill()
    prefill_s = h.step_s[0]
    for s in range(args.steps + args.warmup):
        h.decode(s)
    times = h.step_s[1 + args.warmup:]
    plans = h.plan_s[1 + args.warmup:]
    record = {"config": vars(args) | {"out": str(args.out)}, "prefill_s": prefill_s,
              "state_bytes": h.layer.nbytes(), "rounds": h.layer.rounds,
              "plan_ms_median": 1e3 * statistics.median(plans),
              "decode_step_ms_median": 1e3 * statistics.median(times),
              "decode_step_ms_min": 1e3 * min(times), "decode_step_ms_max": 1e3 * max(times)}
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
