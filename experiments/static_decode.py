"""The static decode step against the default one: operators, host reads and speed per decode step.

One process: every variant is prefilled with its own seeded prompt of T - steps tokens, then the variants take
their decode steps in turn (alternating the order), so load changes hit them alike; the table gives medians.

* operators dispatched per decode step of the whole model (a CPU stand-in for GPU kernel launches), over one
  full eviction cycle of ``drop`` steps, and at the evicting step alone;
* host reads (``aten._local_scalar_dense``: a tensor read back as a number; on a GPU, a synchronisation);
* decode tokens/s: the full cache at T, the full cache at context = budget (the reference), and the
  budgeted cache with ``decode="dynamic"``, ``"static"`` and ``"compiled"``.

    python experiments/static_decode.py --seq-len 2048 --budget 0.2 --steps 24 --out docs/perf/static_decode.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from scissorhands import CacheSettings, ScissorhandsCache
from scissorhands.tools.bench_config import budget_tokens
from scissorhands.tools.bench_steps import forward as _forward
from scissorhands.tools.bench_steps import prefill as _prefill
from scissorhands.tools.bench_steps import tokens as _tokens
from scissorhands.tools.models import load_model


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _cache(model, decode, budget):
    if decode is None:
        return DynamicCache(config=model.config)
    return ScissorhandsCache(model, CacheSettings(decode=decode).with_budget(budget))


def _counts(model, decode, budget, context, drop):
    """Operators and host reads per decode step over one eviction cycle, and at the evicting step."""
    cache = _cache(model, decode, budget)
    with torch.no_grad():
        nxt = _prefill(model, _tokens(model, 1, context, 0), cache, None)
        per_step = []
        for _ in range(2 * drop + 1):
            before = None if decode is None else cache.budgeted_layers[0].kv.compressions
            with _Count() as c:
                nxt = _forward(model, nxt, cache)
            evicted = decode is not None and cache.budgeted_layers[0].kv.compressions != before
            per_step.append((c.ops, c.reads, evicted))
    cycle = per_step[-drop:]
    evicting = [s for s in per_step if s[2]]
    quiet = [s for s in per_step if not s[2]]
    return {"ops_per_step": sum(s[0] for s in cycle) / drop, "reads_per_step": sum(s[1] for s in cycle) / drop,
            "ops_evicting": evicting[-1][0] if evicting else None, "reads_evicting": evicting[-1][1] if evicting
            else None, "ops_quiet": quiet[-1][0] if quiet else None, "reads_quiet": quiet[-1][1] if quiet else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--count-context", type=int, default=512, help="prompt length for the operator counts")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, _ = load_model(args.model, dtype="float32")
    budget = budget_tokens(args.budget, args.seq_len)
    settings = CacheSettings().with_budget(budget)

    count_budget = budget_tokens(args.budget, args.count_context)
    drop = CacheSettings().drop_for(count_budget)
    counts = {name: _counts(model, decode, None if decode is None else count_budget, args.count_context, drop)
              for name, decode in [("full", None), ("dynamic", "dynamic"), ("static", "static")]}

    variants = [("full at T", None, args.seq_len), ("full at budget", None, budget),
                ("dynamic", "dynamic", args.seq_len), ("static", "static", args.seq_len),
                ("compiled", "compiled", args.seq_len)]
    lead = args.steps + args.warmup
    states = []
    compile_s = None
    for i, (name, decode, context) in enumerate(variants):
        cache = _cache(model, decode, budget)
        with torch.no_grad():
            nxt = _prefill(model, _tokens(model, args.batch, context - lead, i), cache, None)
            if decode == "compiled":
                start = time.perf_counter()
                nxt = _forward(model, nxt, cache)  # the first step compiles
                compile_s = time.perf_counter() - start
        states.append({"name": name, "cache": cache, "next": nxt, "times": []})
    with torch.no_grad():
        for step in range(lead):
            for s in (states if step % 2 == 0 else reversed(states)):
                start = time.perf_counter()
                s["next"] = _forward(model, s["next"], s["cache"])
                if step >= args.warmup:
                    s["times"].append(time.perf_counter() - start)
    speed = {s["name"]: args.batch / statistics.median(s["times"]) for s in states}
    ref = speed["full at budget"]
    result = {"model": args.model, "dtype": "float32", "threads": torch.get_num_threads(), "seq_len": args.seq_len,
              "batch": args.batch, "budget": budget, "drop": settings.drop, "steps": args.steps,
              "count_context": args.count_context, "count_budget": count_budget, "count_drop": drop,
              "counts": counts, "tokens_per_s": speed, "vs_reference": {k: v / ref for k, v in speed.items()},
              "compile_s": compile_s}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for name, c in counts.items():
        print(f"{name:<8} ops/step {c['ops_per_step']:8.1f} (evicting {c['ops_evicting']}, quiet {c['ops_quiet']}) "
              f"host reads/step {c['reads_per_step']:.1f} (evicting {c['reads_evicting']})")
    for name, v in speed.items():
        print(f"{name:<16} {v:7.2f} tok/s  {v / ref:.3f}x the reference")
    print(f"compile: {compile_s:.1f} s")


if __name__ == "__main__":
    main()
