"""Markdown tables from the JSONL files of ``defaults_sweep.py`` and ``passkey_grid.py``.

    python benchmarks/sweep_tables.py sweep docs/results/sweep2/stage1.jsonl docs/results/sweep2/stage2.jsonl ...
    python benchmarks/sweep_tables.py passkey docs/results/passkey/results.jsonl
"""

import json
import sys
from pathlib import Path


def _short(settings: dict) -> str:
    keys = ("importance", "recent", "drop", "window", "window_buckets", "sinks", "value_weighted", "merge")
    return ", ".join(f"{k}={settings[k]}" for k in keys if k in settings)


def sweep(paths):
    rows = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            rows.setdefault((r["name"], r["method"]), {})[r["budget"]] = r
    budgets = sorted({b for cells in rows.values() for b in cells}, reverse=True)
    head = "| setting | " + " | ".join(f"ΔNLL at {1 / b:.0f}x" for b in budgets) + " |"
    print(head)
    print("|---" * (len(budgets) + 1) + "|")
    for (name, method), cells in rows.items():
        vals = []
        for b in budgets:
            r = cells.get(b)
            vals.append("" if r is None else f"{r['delta_nll']:+.4f} ±{r['delta_nll_ci95']:.4f}")
        label = name if method == "scissorhands" else f"{name} ({method})"
        print(f"| {label} | " + " | ".join(vals) + " |")


def passkey(path):
    recs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    lengths = list(recs[0]["metrics"]["by_length"])
    print("| cell | recall | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---" * (len(lengths) + 2) + "|")
    for r in recs:
        m = r["metrics"]
        n = m["n"]
        print(f"| {r['name']} | {m['acc'] * n:.0f}/{n} | "
              + " | ".join(f"{m['by_length'][k]:.2f}" for k in lengths) + " |")


if __name__ == "__main__":
    kind, *files = sys.argv[1:]
    sweep(files) if kind == "sweep" else passkey(files[0])
