"""Where a streamed prefill's time goes: per compression event, attention, importance, selection, compaction.

One forward of T tokens under a budget is both a streamed prefill (what
``generate`` runs first) and one window of the exact scorer: the same code
path. This times it against the full cache's forward on the same tokens, splits
the budgeted layers' time into the parts of a compression event by wrapping
the functions that do each part, and counts the torch operators dispatched
(a CPU stand-in for GPU kernel launches) per event and per decode step.

    python experiments/prefill_profile.py --seq-len 1024 --budget 0.1 --out docs/perf/prefill_profile.json

The parts are wall time inside each function (inclusive), summed over every
layer and event; "rest" is the budgeted forward's time beyond the full
forward's not covered by them (the block loop's bookkeeping in Python, the
append, the mask and shape work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import scissorhands.core.attend.blocks as blocks
import scissorhands.core.layer.budgeted as budgeted
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig, budget_tokens
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.tools.generation import demo_prompt
from scissorhands.tools.models import load_model


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Timers:
    """Wraps functions so their inclusive wall time and call count are summed by part name."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.undo: list = []

    def wrap(self, owner, attr: str, part: str):
        real = getattr(owner, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1

        setattr(owner, attr, timed)
        self.undo.append((owner, attr, real))

    def restore(self):
        for owner, attr, real in reversed(self.undo):
            setattr(owner, attr, real)


def forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, logits_to_keep=1).logits


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--budget", type=float, default=0.1, help="fraction of --seq-len, or a token count")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", default=None, help="prefill mode (default: the library's)")
    p.add_argument("--prefill-drop", default=None, help="prefill drop amount, if the library has the setting")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    ids = tok(demo_prompt() * 4, return_tensors="pt").input_ids[:, : args.seq_len]
    budget = budget_tokens(args.budget, ids.shape[1], CacheSettings())
    extra = {}
    if args.prefill is not None:
        extra["prefill"] = args.prefill
    if args.prefill_drop is not None:
        extra["prefill_drop"] = float(args.prefill_drop) if "." in args.prefill_drop else int(args.prefill_drop)
    config = ScissorhandsConfig(budget=budget, **extra)

    def budgeted_cache():
        return ScissorhandsCache(model, config)

    forward(model, ids, DynamicCache(config=model.config))  # warm-up
    forward(model, ids, budgeted_cache())
    full_s, ours_s = [], []
    for _ in range(args.repeats):  # interleaved
        t = time.perf_counter()
        forward(model, ids, DynamicCache(config=model.config))
        full_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        forward(model, ids, budgeted_cache())
        ours_s.append(time.perf_counter() - t)

    timers = Timers()
    timers.wrap(blocks, "attend_stored", "attention")
    timers.wrap(ImportanceState, "observe", "importance update")
    timers.wrap(Scissorhands, "score", "scoring")
    timers.wrap(budgeted, "keep_order", "selection")
    timers.wrap(budgeted.BudgetedKV, "evict", "eviction (selection + compaction)")
    timers.wrap(budgeted.BudgetedKV, "append", "append")
    cache = budgeted_cache()
    t = time.perf_counter()
    forward(model, ids, cache)
    timed_total = time.perf_counter() - t
    timers.restore()
    events = sum(layer.compressions for layer in cache.budgeted_layers)
    parts = dict(timers.seconds)
    compaction = parts.pop("eviction (selection + compaction)") - parts.get("selection", 0.0)
    parts["compaction"] = compaction

    with OpCounter() as full_ops:
        forward(model, ids, DynamicCache(config=model.config))
    with OpCounter() as our_ops:
        forward(model, ids, budgeted_cache())

    # One decode step at context = budget, budgeted (evicting) against the full cache at the same length.
    def decode_ops(cache):
        with torch.no_grad():
            model(ids[:, : budget + 40], cache=cache)
            counter = OpCounter()
            with counter:
                model(ids[:, budget + 40: budget + 41], cache=cache)
        return sum(counter.ops.values())

    record = {
        "model": args.model, "seq_len": int(ids.shape[1]), "budget": budget, "config": config.as_dict(),
        "threads": torch.get_num_threads(),
        "full_forward_s": statistics.median(full_s), "budgeted_forward_s": statistics.median(ours_s),
        "ratio": statistics.median(ours_s) / statistics.median(full_s),
        "events": events, "events_per_layer": events / len(cache.budgeted_layers),
        "timed_forward_s": timed_total,
        "parts_s": parts, "calls": dict(timers.calls),
        "ops_full_forward": sum(full_ops.ops.values()), "ops_budgeted_forward": sum(our_ops.ops.values()),
        "ops_per_event": (sum(our_ops.ops.values()) - sum(full_ops.ops.values())) / max(events, 1),
        "top_ops_budgeted": our_ops.ops.most_common(12),
        "ops_decode_step_full": decode_ops(DynamicCache(config=model.config)),
        "ops_decode_step_budgeted": decode_ops(budgeted_cache()),
    }
    print(json.dumps(record, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
