"""A streamed prefill's time with demotion (``kv_demote``) against plain packed K/V and the dense store.

Each round runs every variant once, in turn, on the same random prompt (the prompt's tokens do not change the
work of a streamed prefill), so the variants alternate; the report is each variant's median and the spread of
the per-round ratios to plain packed K/V.

    python experiments/demotion_prefill.py --prompt-tokens 1024 --budget 200 --rounds 5 \
        --out docs/perf/demotion_prefill.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.tools.models import load_model

VARIANTS = {
    "dense": {},
    "4-bit": {"kv_bits": 4},
    "8:0.3 then 4-bit": {"kv_bits": 4, "kv_demote": "8:0.3"},
    "16:0.3,4:0.6 then 2-bit": {"kv_bits": 2, "kv_demote": "16:0.3,4:0.6"},
}


def prefill_seconds(model, ids: torch.Tensor, budget: int, settings: dict) -> float:
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, prefill="stream", **settings))
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--budget", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, _ = load_model(args.model, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens))
    for settings in VARIANTS.values():  # warm-up: first-call allocations and lazy imports
        prefill_seconds(model, ids[:, : args.budget + 64], args.budget, settings)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, settings in VARIANTS.items():
            times[name].append(prefill_seconds(model, ids, args.budget, settings))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    rows = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["4-bit"])]
        rows[name] = {"median_s": statistics.median(ts), "times_s": ts,
                      "ratio_to_4bit_median": statistics.median(ratios),
                      "ratio_to_4bit_range": [min(ratios), max(ratios)]}
        print(f"{name:>24}: median {rows[name]['median_s']:.2f} s, x{rows[name]['ratio_to_4bit_median']:.2f} of 4-bit "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "variants": VARIANTS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
