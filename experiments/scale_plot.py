"""ΔNLL at 5x and 10x against model size, on one text and protocol: does a larger model tolerate more?

Each argument is ``LABEL:PARAMETERS:RUN``. RUN is an ``eval --out`` folder with a ``full`` row and
``scissorhands`` rows at budgets 0.2 and 0.1 on the same windows, or a ``defaults_sweep.py`` record (a
``.jsonl`` file with its ``.full.json`` beside it), whose ``defaults`` rows are read.

    python experiments/scale_plot.py smollm2-135m:135e6:docs/results/prefill_drop/pd_none \\
        qwen2.5-coder-0.5b:494e6:docs/results/qwen/q05_prose_2k \\
        qwen2.5-coder-1.5b:1.54e9:docs/results/qwen/q15_prose_2k \\
        --out docs/analysis/scale.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scissorhands.tools.eval.runner import load_results
from scissorhands.tools.stats import paired_difference


def deltas(folder: Path) -> dict:
    if folder.suffix == ".jsonl":  # a defaults_sweep.py record
        full = json.loads(folder.with_suffix(".full.json").read_text())["nll"]
        rows = {r["budget"]: r for r in map(json.loads, folder.read_text().splitlines()) if r["name"] == "defaults"}
        return {b: (*paired_difference(rows[b]["nll"], full), len(full)) for b in (0.2, 0.1)}
    rows = {(r["method"], r["budget"]): r for r in load_results(folder / "results.jsonl")}
    base = [s["nll"] for s in rows[("full", None)]["item_scores"]]
    out = {}
    for budget in (0.2, 0.1):
        mine = [s["nll"] for s in rows[("scissorhands", budget)]["item_scores"]]
        out[budget] = (*paired_difference(mine, base), len(mine))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="LABEL:PARAMETERS:EVAL_DIR")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for run in args.runs:
        label, params, folder = run.split(":", 2)
        points.append((label, float(params), deltas(Path(folder))))
    print("| model | parameters | windows | ΔNLL at 5x | ΔNLL at 10x |")
    print("|---|---|---|---|---|")
    for label, params, d in points:
        print(f"| {label} | {params / 1e6:.0f}M | {d[0.2][2]} | {d[0.2][0]:+.4f} ±{d[0.2][1]:.4f} | "
              f"{d[0.1][0]:+.4f} ±{d[0.1][1]:.4f} |")
    fig, ax = plt.subplots(figsize=(6, 4))
    for budget, name in ((0.2, "5x"), (0.1, "10x")):
        xs = [p for _, p, _ in points]
        ys = [d[budget][0] for _, _, d in points]
        ax.errorbar(xs, ys, yerr=[d[budget][1] for _, _, d in points], marker="o", capsize=3, label=name)
    for label, params, d in points:
        ax.annotate(label, (params, d[0.1][0]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("ΔNLL against the full cache (nats/token)")
    ax.set_title("Shakespeare, T = 2,048, shipped defaults")
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
