"""Paired differences between two eval runs on the same windows: how a setting changes each row.

Each run is an ``eval --out`` folder. Rows are matched by task, method and budget; the per-item NLLs
(or right/wrong answers) are paired item by item. Both runs must score the same items: the same text,
``--seq-len``, ``--num-samples`` and ``--seed``. A setting that changes the items is refused.

    python experiments/paired_runs.py BASE_DIR OTHER_DIR [--full FULL_DIR]
    python experiments/paired_runs.py RUN_DIR --against scissorhands [--where prefill=stream,importance=mean]

This prints OTHER - BASE per row with a 95% interval. With ``--full``, it also prints each run against
the full cache of FULL_DIR (default: BASE_DIR's own full row). With ``--against METHOD`` and one run, it
pairs METHOD with every other method of that run at the same budget: METHOD - peer, so negative means
METHOD loses less (for a pass rate or an accuracy, positive means METHOD gets more right, and McNemar's p is
printed beside it). Where one method has several rows at a budget (two runs into one folder, ``--prefill``
then ``--preset paper``), ``--where`` picks METHOD's row by its settings, and each peer row is named by the
settings that set it apart, as the run's summary names it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scissorhands.core.settings.declare import parse_text
from scissorhands.tools.eval.records import load_results
from scissorhands.tools.eval.report import row_labels
from scissorhands.tools.stats import mcnemar_p, paired_difference, plus_minus


def _values(row: dict) -> list[float]:
    scores = row["item_scores"]
    key = "nll" if row["task"] == "ppl" else "passed" if row["task"].startswith("humaneval") else "correct"
    return [float(s[key]) for s in scores]


def _rows(folder: Path) -> dict:
    return {(r["task"], r["method"], r["budget"]): r for r in load_results(folder / "results.jsonl")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", type=Path)
    p.add_argument("other", type=Path, nargs="?")
    p.add_argument("--full", type=Path, default=None, help="the run whose full-cache rows both are compared with")
    p.add_argument("--against", default=None, metavar="METHOD",
                   help="one run: METHOD against every other method of it, budget by budget")
    p.add_argument("--where", default="", metavar="KEY=VALUE,...",
                   help="with --against: METHOD's row is the one whose settings have these values")
    args = p.parse_args(argv)
    if (args.against is None) == (args.other is None):
        p.error("other: give a second run, or --against METHOD with one run")
    if args.against is not None:
        return _against(load_results(args.base / "results.jsonl"), args.against, args.where)
    base, other = _rows(args.base), _rows(args.other)
    full_rows = _rows(args.full) if args.full else base
    print(f"| task | method | budget | {args.other.name} - {args.base.name} | {args.base.name} vs full | "
          f"{args.other.name} vs full |")
    print("|---|---|---|---|---|---|")
    for key in sorted(set(base) & set(other), key=str):
        task, method, budget = key
        if method == "full":
            continue
        a, b = _values(base[key]), _values(other[key])
        if len(a) != len(b):
            print(f"{key}: {len(a)} against {len(b)} items; not the same windows", file=sys.stderr)
            return 2
        full = full_rows.get((task, "full", None))
        cells = [paired_difference(b, a)]
        if full is not None:
            f = _values(full)
            cells += [paired_difference(a, f), paired_difference(b, f)]
        text = " | ".join(f"{m:+.4f}{plus_minus(h, 4)}" for m, h in cells)
        print(f"| {task} | {method} | {budget} | {text} |")
    return 0


def _against(results: list[dict], ours: str, where: str) -> int:
    """METHOD - peer per (task, budget) of one run, with the 95% interval of the paired difference."""
    wanted = dict(pair.split("=", 1) for pair in where.split(",") if pair)
    labels = row_labels(results)

    def matches(row: dict) -> bool:
        config = row.get("config") or {}
        return all(parse_text(str(config.get(k))) == v for k, v in wanted.items())

    mine: dict = {}
    for row in results:
        if row["method"] == ours and matches(row):
            key = (row["task"], row["budget"])
            if key in mine:
                print(f"where: several {ours!r} rows at {key}; name the settings that pick one", file=sys.stderr)
                return 2
            mine[key] = row
    if not mine:
        print(f"against: no {ours!r} rows in this run{' with ' + where if where else ''}", file=sys.stderr)
        return 2
    print(f"| task | budget | {ours} - peer | McNemar p | peer |")
    print("|---|---|---|---|---|")
    for row, label in sorted(zip(results, labels), key=lambda x: str((x[0]["task"], x[0]["budget"], x[1]))):
        key = (row["task"], row["budget"])
        if row["method"] == "full" or key not in mine or row is mine[key]:
            continue
        a, b = _values(mine[key]), _values(row)
        mean, half = paired_difference(a, b)
        test = ""
        if set(a) | set(b) <= {0.0, 1.0}:  # right or wrong per item: McNemar's exact test on the discordant pairs
            test = f"{mcnemar_p(sum(x > y for x, y in zip(a, b)), sum(y > x for x, y in zip(a, b))):.2g}"
        print(f"| {row['task']} | {row['budget']} | {mean:+.4f}{plus_minus(half, 4)} | {test} | {label} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
