"""The importance forms at every length: the plain mean, the sum and the capped mean (the default), per cell.

Each cell is an ``eval --out`` folder (or a ``defaults_sweep.py`` file) scored at one length, with a row of
each form: ``importance="mean"`` with ``mean_cap=None`` (rows written before the cap existed are the plain
mean), ``importance="sum"`` (the ``h2o`` method, or the defaults with that importance) and
``importance="mean"`` with ``mean_cap=2048``. Prints ΔNLL against the full cache (± a paired 95% interval
where there are several windows), and the capped mean's distance from the better of the other two.

    python experiments/length_table.py "0.5B, prose, 8,192=docs/results/qwen/long8k/long8k_q05.jsonl" \\
        "0.5B, code, 8,192=docs/results/qwen/q05_code_8k" ...
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.stats import paired_difference

FORMS = ("mean", "sum", "capped")


def _form(settings: dict, method: str) -> str | None:
    if method == "h2o" or settings.get("importance") == "sum":
        return "sum"
    if method == "scissorhands" and settings.get("importance") == "mean":
        cap = settings.get("mean_cap")
        return "mean" if cap is None else "capped" if cap == 2048 else None
    return None


def _is_default(settings: dict) -> bool:
    """Only the cap and the importance may differ from the defaults (a cell's other rows are left out)."""
    return settings.get("recent") == 0.25 and settings.get("window") is None and settings.get("drop") == 0.05


def cell_rows(path: Path, budget: float) -> tuple[dict[str, list[float]], list[float] | None]:
    """Per-window ΔNLL of each form at ``budget`` (a fraction), and the full cache's per-window NLLs."""
    if path.is_dir():
        rows = load_results(path / "results.jsonl")
        full = next((r for r in rows if r["method"] == "full" and r["task"] == "ppl"), None)
        if full is None:
            raise SystemExit(f"length_table: error: cells: {path} has no full-cache row")
        base = [float(s["nll"]) for s in full["item_scores"]]
        out: dict[str, list[float]] = {}
        for r in rows:
            settings = r.get("config") or {}
            if r["task"] != "ppl" or r["budget"] != budget or not _is_default(settings):
                continue
            form = _form(settings, r["method"])
            if form is not None:
                out[form] = [float(s["nll"]) - b for s, b in zip(r["item_scores"], base)]
        return out, base
    sweep = [json.loads(line) for line in path.read_text().splitlines()]
    full_file = path.with_suffix(".full.json")
    base = json.loads(full_file.read_text())["nll"]
    out = {}
    for r in sweep:
        if r["budget"] != budget or not _is_default(r["settings"]):
            continue
        form = _form(r["settings"], r["method"])
        if form is not None:
            out[form] = [n - b for n, b in zip(r["nll"], base)]
    return out, base


def show(values: list[float]) -> str:
    """Mean and, over several windows, its 95% half-width."""
    m, ci = paired_difference(values, [0.0] * len(values))
    return f"{m:+.4f}" + (f" ±{ci:.4f}" if len(values) > 1 and math.isfinite(ci) else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cells", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--budget", type=float, default=0.2, help="the budget fraction (0.2: 5x)")
    args = p.parse_args(argv)
    print("| model, text, T | windows | mean | sum | **capped mean (default)** | capped − better of the two |")
    print("|---|---|---|---|---|---|")
    for spec in args.cells:
        label, _, path = spec.rpartition("=")
        if not label:
            raise SystemExit(f"length_table: error: cells: LABEL=PATH, got {spec!r}")
        forms, _ = cell_rows(Path(path), args.budget)
        if set(FORMS) - set(forms):
            raise SystemExit(f"length_table: error: cells: {path} lacks {sorted(set(FORMS) - set(forms))} at "
                             f"budget {args.budget}")
        n = len(forms["mean"])
        better = "mean" if sum(forms["mean"]) <= sum(forms["sum"]) else "sum"
        gap = [c - b for c, b in zip(forms["capped"], forms[better])]
        print(f"| {label} | {n} | {show(forms['mean'])} | {show(forms['sum'])} | **{show(forms['capped'])}** | "
              f"{show(gap)} ({better}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
