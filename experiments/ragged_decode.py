"""Decode step time of a ragged batch (rows left-padded by different amounts) against an aligned one.

    python experiments/ragged_decode.py --batch 8 --prompt 512 --pad-step 16 --budgets 256,1024 --steps 12 \
        --out docs/bench/ragged.json

The aligned batch takes the fast path (one token per row, rows in step); the ragged batch takes the
block path, and its rows reach the budget at different steps. Variants are prefilled, then stepped in
turn (interleaved, alternating order) after ``--warmup`` steps; the table gives median step times and the
ragged / aligned ratio per budget, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.tools.models import load_model


def batch_ids(vocab: int, batch: int, prompt: int, pad_step: int, seed: int):
    """(ids, mask): ``batch`` rows of ``prompt`` tokens, row ``i`` left-padded by ``i * pad_step`` (0 = aligned)."""
    gen = torch.Generator().manual_seed(seed)
    width = prompt + (batch - 1) * pad_step
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i in range(batch):
        n = prompt + (batch - 1 - i) * pad_step if pad_step else prompt
        ids[i, width - n:] = torch.randint(16, vocab, (n,), generator=gen)
        mask[i, width - n:] = 1
    if not pad_step:
        return ids[:, -prompt:], mask[:, -prompt:]
    return ids, mask


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--pad-step", type=int, default=16)
    p.add_argument("--budgets", default="256,1024")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.batch < 2 or args.pad_step < 1 or args.steps < 1 or args.prompt < 2:
        print("error: batch must be >= 2, pad-step >= 1, steps >= 1, prompt >= 2", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    vocab = model.config.vocab_size
    runs = []
    for budget in (int(b) for b in args.budgets.split(",")):
        for kind, pad in (("aligned", 0), ("ragged", args.pad_step)):
            ids, mask = batch_ids(vocab, args.batch, args.prompt, pad, seed=budget)
            cache = ScissorhandsCache(model, ScissorhandsConfig(budget=budget))
            with torch.no_grad():
                out = model(ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
            runs.append({"budget": budget, "kind": kind, "cache": cache, "mask": mask, "times": [],
                         "next": out.logits[:, -1].argmax(-1, keepdim=True)})
    with torch.no_grad():
        for step in range(args.warmup + args.steps):
            for r in (runs if step % 2 == 0 else runs[::-1]):
                r["mask"] = torch.cat([r["mask"], torch.ones_like(r["mask"][:, :1])], dim=1)
                start = time.perf_counter()
                out = model(r["next"], attention_mask=r["mask"], cache=r["cache"], use_cache=True, logits_to_keep=1)
                r["next"] = out.logits[:, -1].argmax(-1, keepdim=True)
                if step >= args.warmup:
                    r["times"].append(time.perf_counter() - start)
    rows = []
    print("| budget | aligned (ms) | ragged (ms) | ragged / aligned | compressions aligned / ragged |")
    print("|---|---|---|---|---|")
    for budget in dict.fromkeys(r["budget"] for r in runs):
        a, g = (next(r for r in runs if r["budget"] == budget and r["kind"] == k) for k in ("aligned", "ragged"))
        ma, mg = statistics.median(a["times"]), statistics.median(g["times"])
        ca = sum(layer.compressions for layer in a["cache"].budgeted_layers)
        cg = sum(layer.compressions for layer in g["cache"].budgeted_layers)
        rows.append({"budget": budget, "aligned_s": a["times"], "ragged_s": g["times"], "aligned_median_s": ma,
                     "ragged_median_s": mg, "ratio": mg / ma, "compressions": [ca, cg]})
        print(f"| {budget} | {1e3 * ma:.0f} | {1e3 * mg:.0f} | {mg / ma:.2f} | {ca} / {cg} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
