"""Sweep cache settings with the exact scorer and report paired NLL changes against the full cache.

The model is loaded once and the same text windows are scored for every
setting, so differences are paired. Each setting is a JSON object of
``CacheSettings`` fields; results append to a JSONL file (one line per setting
and budget) and a setting already there is not recomputed. The full cache's
NLLs are kept beside it (``OUT.full.json``) with the model, dtype and windows
that made them; a later run into the same file with any of these changed is
refused, so rows of two runs are never paired.

    python experiments/defaults_sweep.py --settings experiments/configs/sweep_stage1.json --budgets 0.2,0.1 \
        --seq-len 2048 --num-samples 8 --out stage1.jsonl

The dtype is float32 unless ``--dtype`` says otherwise (the SmolLM2 sweeps in
docs/appendix/results_log.md ran in bfloat16, and their commands say so).
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

from scissorhands import CacheSettings, ScissorhandsCache, budget_tokens, get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs
from scissorhands.tools.eval.tasks import Perplexity
from scissorhands.tools.models import load_model
from scissorhands.tools.paths import check_same_run
from scissorhands.tools.stats import paired_difference


def window_nll(model, ids, method, budget, settings) -> tuple[float, dict | None]:
    """Mean NLL of one window, and the byte totals of the cache that scored it."""
    setup = ScoreSetup(get_method(method), budget, settings)
    cache = setup.make_cache(model, len(ids))
    lp, _ = token_logprobs(model, torch.tensor(ids), setup, cache=cache)
    memory = None
    if isinstance(cache, ScissorhandsCache):
        memory = {k: v for k, v in cache.memory_report().items() if k not in ("layers", "stored_per_layer")}
    return float(-lp.mean()), memory


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True, help="JSON file: {name: {field: value, ...}, ...}")
    p.add_argument("--budgets", default="0.2,0.1")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--num-samples", type=int, default=8)
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    grid = json.loads(Path(args.settings).read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    full_path = out.with_suffix(".full.json")
    full_record = json.loads(full_path.read_text()) if full_path.is_file() else None
    run = {"model": args.model, "dtype": args.dtype, "seq_len": args.seq_len, "num_samples": args.num_samples}
    check_same_run(out, records + ([full_record] if full_record else []), run)
    done = {(r["name"], r["budget"], r["method"]) for r in records}
    model, tok = load_model(args.model, dtype=args.dtype)
    items = Perplexity(args.seq_len, args.num_samples).items(tok, None)
    if full_record is not None:
        full = full_record["nll"]
    else:
        full = [window_nll(model, it.data["ids"], "full", None, CacheSettings())[0] for it in items]
        full_path.write_text(json.dumps({"nll": full, **run}))
    for name, fields in grid.items():
        method = fields.pop("method", args.method)
        settings = get_method(method).resolve(CacheSettings(**fields))
        for spec in [float(b) for b in args.budgets.split(",")]:
            if (name, spec, method) in done:
                continue
            start = time.perf_counter()
            scored = [window_nll(model, it.data["ids"], method,
                                 budget_tokens(spec, it.length, settings, get_method(method)), settings)
                      for it in items]
            nll = [n for n, _ in scored]
            delta, half = paired_difference(nll, full)
            rec = {"name": name, "method": method, "budget": spec, "settings": settings.as_dict(),
                   "delta_nll": delta, "delta_nll_ci95": half, "ppl": math.exp(sum(nll) / len(nll)),
                   "ppl_full": math.exp(sum(full) / len(full)), "nll": nll, **run, "memory": scored[0][1],
                   "wall_s": time.perf_counter() - start}
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{name:<40} {method:<14} budget {spec:<5} dNLL {delta:+.4f} ±{half:.4f} "
                  f"({rec['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
