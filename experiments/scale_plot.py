"""ΔNLL at 5x and 10x against model size, on one text and protocol: does a larger model tolerate more?

Each argument is ``LABEL:PARAMETERS:RUN``. RUN is an ``eval --out`` folder with a ``full`` row and
``scissorhands`` rows at budgets 0.2 and 0.1 on the same windows, or a ``defaults_sweep.py`` record (a
``.jsonl`` file with its ``.full.json`` beside it), whose ``defaults`` rows are read.

    python experiments/scale_plot.py smollm2-135m:135e6:docs/results/prefill_drop/pd_none \\
        qwen2.5-coder-0.5b:494e6:docs/results/qwen/q05_prose_2k \\
        qwen2.5-coder-1.5b:1.54e9:docs/results/qwen/q15_prose_2k \\
        --out docs/analysis/scale.png

Two models that share a tokenizer score the very same windows, so their losses can be paired window by
window: ``--same-windows qwen2.5-coder-0.5b,qwen2.5-coder-1.5b`` prints the second's ΔNLL minus the first's
at each budget, with a 95% interval (negative: the second model loses less). Runs with different window
counts are refused; that the tokenizers agree is the caller's claim.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.stats import paired_difference


def window_deltas(folder: Path) -> dict[float, list[float]]:
    """Per window, the defaults' NLL minus the full cache's, at budgets 0.2 and 0.1."""
    if folder.suffix == ".jsonl":  # a defaults_sweep.py record
        full = json.loads(folder.with_suffix(".full.json").read_text())["nll"]
        rows = {r["budget"]: r for r in map(json.loads, folder.read_text().splitlines()) if r["name"] == "defaults"}
        return {b: [a - f for a, f in zip(rows[b]["nll"], full)] for b in (0.2, 0.1)}
    rows = {(r["method"], r["budget"]): r for r in load_results(folder / "results.jsonl")}
    base = [s["nll"] for s in rows[("full", None)]["item_scores"]]
    return {b: [s["nll"] - f for s, f in zip(rows[("scissorhands", b)]["item_scores"], base)] for b in (0.2, 0.1)}


def deltas(folder: Path) -> dict:
    """Mean ΔNLL, its 95% interval and the window count at budgets 0.2 and 0.1."""
    return {budget: (*paired_difference(values, [0.0] * len(values)), len(values))
            for budget, values in window_deltas(folder).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="LABEL:PARAMETERS:EVAL_DIR")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--same-windows", action="append", default=[], metavar="LABEL_A,LABEL_B",
                   help="two runs on the same windows (models sharing a tokenizer): print B's ΔNLL minus A's, "
                        "paired window by window; may be given more than once")
    args = p.parse_args(argv)
    folders = {}
    for run in args.runs:
        parts = run.split(":", 2)
        if len(parts) != 3:
            p.error(f"runs: {run!r} is not LABEL:PARAMETERS:RUN")
        folders[parts[0]] = Path(parts[2])
    pairs = []
    for pair in args.same_windows:
        names = pair.split(",")
        if len(names) != 2 or any(n not in folders for n in names):
            p.error(f"same-windows: {pair!r} is not two of the run labels {', '.join(folders)} joined by a comma")
        pairs.append(names)
    import matplotlib
    import matplotlib.ticker

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
    for a, b in pairs:
        da, db = window_deltas(folders[a]), window_deltas(folders[b])
        for budget, name in ((0.2, "5x"), (0.1, "10x")):
            if len(da[budget]) != len(db[budget]):
                p.error(f"same-windows: {a} has {len(da[budget])} windows and {b} {len(db[budget])}")
            mean, half = paired_difference(db[budget], da[budget])
            print(f"{b} - {a}, {name}, paired over {len(da[budget])} windows: {mean:+.4f} ±{half:.4f}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for budget, name in ((0.2, "5x"), (0.1, "10x")):
        xs = [p for _, p, _ in points]
        ys = [d[budget][0] for _, _, d in points]
        ax.errorbar(xs, ys, yerr=[d[budget][1] for _, _, d in points], marker="o", capsize=3, label=name)
    for label, params, d in points:
        ax.annotate(label, (params, d[0.1][0]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    sizes = sorted({params for _, params, _ in points})
    ax.set_xticks(sizes, [f"{x / 1e9:g}B" if x >= 1e9 else f"{x / 1e6:.0f}M" for x in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 2.2)  # room for the last label
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
