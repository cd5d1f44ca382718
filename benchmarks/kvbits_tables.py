"""Markdown tables for the eviction x quantisation grid, from a ``defaults_sweep.py`` JSONL (settings named by bits).

Quality: ΔNLL against the bf16 full cache, paired over windows. Memory: the
measured bytes of the cache that scored the first window, against what a bf16
full cache holds for the same tokens (1.0 for the bf16 full cache itself).
Compounding: each window's loss of the combination minus the sum of the two
separate losses (eviction alone at that budget, quantisation alone without
eviction), mean and 95% interval over windows.

    python benchmarks/kvbits_tables.py docs/results/kvbits/grid.jsonl
"""

import json
import sys
from pathlib import Path

from scissorhands.stats import mean_ci

LABELS = {"kv16": "16 (bf16)", "kv8": "8", "k8v4": "K 8 / V 4", "kv4": "4", "k8v2": "K 8 / V 2", "kv2": "2"}


def load(path):
    cells = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        cells[(r["name"], r["budget"])] = r
    full = json.loads(Path(path).with_suffix(".full.json").read_text())["nll"]
    return cells, full


def reductions(r):
    m = r.get("memory")
    if m is None:  # a DynamicCache in the model's dtype (bf16): the reference itself
        return 1.0, 1.0
    return m["kv_reduction_vs_bf16"], m["total_reduction_vs_bf16"]


def main(path):
    cells, full = load(path)
    names = [n for n in LABELS if any(k[0] == n for k in cells)]
    budgets = sorted({b for _, b in cells}, reverse=True)
    head = "| bits | " + " | ".join(f"budget {b}" for b in budgets) + " |\n" + "|---" * (len(budgets) + 1) + "|"

    print("ΔNLL against the bf16 full cache (nats/token, 95% interval):\n")
    print(head)
    for n in names:
        row = [cells.get((n, b)) for b in budgets]
        print(f"| {LABELS[n]} | " + " | ".join("" if r is None else f"{r['delta_nll']:+.4f} ±{r['delta_nll_ci95']:.4f}"
                                           for r in row) + " |")

    print("\nMeasured reduction against a bf16 full cache: K/V bytes only / K/V + importance state + positions:\n")
    print(head)
    for n in names:
        row = [cells.get((n, b)) for b in budgets]
        print(f"| {LABELS[n]} | " + " | ".join(
            "" if r is None else "{:.1f}x / {:.1f}x".format(*reductions(r)) for r in row) + " |")

    print("\nCompounding: loss of the combination minus (eviction alone + quantisation alone), paired per window:\n")
    evicting = [b for b in budgets if b < 1.0]
    print("| bits | " + " | ".join(f"budget {b}" for b in evicting) + " |\n" + "|---" * (len(evicting) + 1) + "|")
    for n in names:
        if n == "kv16" or (n, 1.0) not in cells:
            continue
        quant = cells[(n, 1.0)]["nll"]
        vals = []
        for b in evicting:
            combo, evict = cells.get((n, b)), cells.get(("kv16", b))
            if combo is None or evict is None:
                vals.append("")
                continue
            excess = [c - e - q + f for c, e, q, f in zip(combo["nll"], evict["nll"], quant, full)]
            mean, half = mean_ci(excess)
            vals.append(f"{mean:+.4f} ±{half:.4f}")
        print(f"| {LABELS[n]} | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
