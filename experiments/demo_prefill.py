"""The demo's prefill time, under this checkout's code and under another revision's, interleaved.

The demo's prompt (about 1,100 SmolLM2 tokens: the opening of Hamlet and a question) is built once by this
checkout. Each round then runs one process per source tree, in turn, and each process times the prompt's
prefill with the full cache (transformers' DynamicCache) and with the budgeted cache at the demo's budget.
The settings are given explicitly, so an older revision runs the same ones.

    git worktree add ../before a13b941
    python experiments/demo_prefill.py --src ../before/src,src --rounds 3 --out docs/perf/demo_prefill.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"recent": 0.25, "drop": 0.05, "importance": "mean", "window": None, "window_buckets": 8}


def worker(ids_file: str, budget: int, repeats: int) -> dict:
    import torch
    from transformers import DynamicCache

    from scissorhands import CacheSettings, ScissorhandsCache
    from scissorhands.tools.models import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, _ = load_model("smollm2-135m", dtype="float32")
    ids = torch.tensor(json.loads(Path(ids_file).read_text()))[None]
    times: dict[str, list[float]] = {"full": [], "budgeted": []}
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first is a warm-up
            for name in times:
                cache = (DynamicCache(config=model.config) if name == "full" else
                         ScissorhandsCache(model, CacheSettings(**SETTINGS).with_budget(budget)))
                start = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--src", required=True, help="comma list of source trees (each holding the scissorhands package)")
    p.add_argument("--budget", type=int, default=200, help="the demo's budget")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="timed prefills per process, after one warm-up")
    p.add_argument("--out", required=True)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))))
        return
    from scissorhands.tools.generation import demo_chat
    from scissorhands.tools.models import load_model

    _, tok = load_model("smollm2-135m", dtype="float32")
    ids = tok(demo_chat(tok), add_special_tokens=False)["input_ids"]
    trees = args.src.split(",")  # as given: the record names them so
    runs: dict[str, dict[str, list[float]]] = {t: {"full": [], "budgeted": []} for t in trees}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    for r in range(args.rounds):
        for tree in (trees if r % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()))
            proc = subprocess.run([sys.executable, __file__, "--src", tree, "--out", "-", "--worker", f.name,
                                   str(args.budget), str(args.repeats)], env=env, capture_output=True, text=True,
                                  check=True)
            one = json.loads(proc.stdout.strip().splitlines()[-1])
            for name in one:
                runs[tree][name] += one[name]
    result = {"prompt_tokens": len(ids), "budget": args.budget, "settings": SETTINGS, "rounds": args.rounds,
              "trees": {}}
    for tree in trees:
        full, budgeted = statistics.median(runs[tree]["full"]), statistics.median(runs[tree]["budgeted"])
        result["trees"][tree] = {"full_s": full, "budgeted_s": budgeted, "ratio": budgeted / full,
                                 "all": runs[tree]}
        print(f"{tree}: full {full:.2f} s, budgeted {budgeted:.2f} s, {budgeted / full:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
