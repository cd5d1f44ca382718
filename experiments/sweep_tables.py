"""Markdown tables from the JSONL files of ``defaults_sweep.py`` and ``passkey_grid.py``.

    python experiments/sweep_tables.py sweep docs/results/sweep2/stage1.jsonl docs/results/sweep2/stage2.jsonl ...
    python experiments/sweep_tables.py passkey docs/results/passkey/results.jsonl
    python experiments/sweep_tables.py long docs/results/long/t4096.jsonl docs/results/long/t8192.jsonl
    python experiments/sweep_tables.py protect docs/results/protect/trials.jsonl
"""

import argparse
import json
from pathlib import Path


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


def long(paths):
    """ΔNLL against the full cache by method, for each length and compression (one column per budget)."""
    for path in paths:
        recs = [json.loads(line) for line in Path(path).read_text().splitlines()]
        budgets = sorted({r["budget"] for r in recs}, reverse=True)
        first = recs[0]
        print(f"\nT = {first['seq_len']}, {first['num_samples']} window(s), full-cache perplexity "
              f"{first['ppl_full']:.2f}\n")
        print("| setting | " + " | ".join(f"{1 / b:.0f}x: ppl, ΔNLL" for b in budgets) + " |")
        print("|---" * (len(budgets) + 1) + "|")
        rows: dict = {}
        for r in recs:
            rows.setdefault(r["name"], {})[r["budget"]] = r
        for name, cells in rows.items():
            vals = []
            for b in budgets:
                r = cells.get(b)
                ci = f" ±{r['delta_nll_ci95']:.4f}" if r is not None and r["num_samples"] > 1 else ""
                vals.append("" if r is None else f"{r['ppl']:.2f}, {r['delta_nll']:+.4f}{ci}")
            print(f"| {name} | " + " | ".join(vals) + " |")


def protect(path):
    """Recall per cell, and when the audit saw the fact go in the unprotected runs."""
    recs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    cells: dict = {}
    for r in recs:
        cells.setdefault(r["cell"], []).append(r)
    print("| cell | recall | code held at the end (mean over layers) | code first evicted (step, median) |")
    print("|---|---|---|---|")
    for cell, rs in cells.items():
        n, hit = len(rs), sum(r["recalled"] for r in rs)
        held, first = "", ""
        if "audit" in rs[0]:
            fr = [sum(h.values()) / len(h) for h in (r["audit"]["code"]["held_fraction"] for r in rs)]
            held = f"{100 * sum(fr) / n:.0f}%"
            steps = sorted(r["audit"]["code"]["first_evicted_step_any_layer"] for r in rs
                           if r["audit"]["code"]["first_evicted_step_any_layer"] is not None)
            lengths = [r["n_prompt"] for r in rs]
            first = "never" if not steps else (f"{steps[len(steps) // 2]} of {min(lengths)}-{max(lengths)} "
                                               f"({len(steps)}/{n} trials lost it)")
        print(f"| {cell} | {hit}/{n} | {held} | {first} |")


if __name__ == "__main__":
    tables = {"sweep": sweep, "passkey": lambda f: passkey(f[0]), "long": long, "protect": lambda f: protect(f[0])}
    ap = argparse.ArgumentParser(description="Markdown tables from the JSONL files of defaults_sweep.py, "
                                             "passkey_grid.py and protect_demo.py.")
    ap.add_argument("kind", choices=list(tables), help="which table")
    ap.add_argument("files", nargs="+", help="the JSONL files (passkey and protect read the first)")
    args = ap.parse_args()
    tables[args.kind](args.files)
