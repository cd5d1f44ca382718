"""One table of every method against the full cache, for several eval runs: rows by method, columns by budget.

Each group is ``LABEL=DIR[,DIR...]``: eval ``--out`` folders scored on the same items (the same text,
``--seq-len``, ``--num-samples``), for example a run of the peers and a ``--preset paper`` run beside it.
Every row is paired item by item with the group's full cache (the first folder with a full row), and the
lowest loss at each budget is in bold.

    python experiments/peer_table.py "0.5B, prose, 2,048=docs/results/qwen/q05_prose_2k,PAPER_RUN" \
        "1.5B, prose, 8,192=docs/results/qwen/q15_prose_8k"

The scissorhands rows are named ``defaults``, or ``paper`` for a run with ``--preset paper``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scissorhands.core.settings.config import DEFAULTS, PRESETS
from scissorhands.tools.eval.records import load_results
from scissorhands.tools.stats import paired_difference, plus_minus

ORDER = ("defaults", "paper", "h2o", "tova", "streaming")


def _label(row: dict) -> str:
    """``defaults``, ``paper``, or ``scissorhands (field=value, ...)`` for a scissorhands row; else the method."""
    if row["method"] != "scissorhands":
        return row["method"]
    config = row["config"]
    if all(config.get(k) == v for k, v in PRESETS["paper"].items()):
        return "paper"
    changed = {k: v for k, v in config.items() if k != "preset" and k in DEFAULTS.as_dict()
               and DEFAULTS.as_dict()[k] != v}
    return "defaults" if not changed else "scissorhands (" + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")"


def _nll(row: dict) -> list[float]:
    return [float(s["nll"]) for s in row["item_scores"]]


def group_rows(folders: list[Path]) -> tuple[dict, dict[tuple[str, float], tuple[float, float]]]:
    """The group's full-cache row and ``{(label, budget): (mean, half)}`` of ΔNLL against it.

    Raises
    ------
    ValueError
        ``"<folder>: ..."`` when no folder has a full row, or a row scores another number of items.
    """
    rows = [r for folder in folders for r in load_results(folder / "results.jsonl") if r["task"] == "ppl"]
    full = next((r for r in rows if r["method"] == "full"), None)
    if full is None:
        raise ValueError(f"{folders[0]}: no full-cache row in this group")
    base = _nll(full)
    out = {}
    for r in rows:
        if r["method"] == "full" or not isinstance(r["budget"], (int, float)):
            continue
        mine = _nll(r)
        if len(mine) != len(base):
            raise ValueError(f"{r['method']} {r['budget']}: {len(mine)} items against the full cache's {len(base)}")
        out[(_label(r), float(r["budget"]))] = paired_difference(mine, base)  # a later run of a cell wins
    return full, out


def table(groups: list[tuple[str, list[Path]]]) -> str:
    budgets = sorted({b for _, folders in groups for (_, b) in group_rows(folders)[1]}, reverse=True)
    lines = ["| model, text, T | windows | full-cache ppl | method | "
             + " | ".join(f"{1 / b:.0f}x" for b in budgets) + " |", "|---|---|---|---|" + "---|" * len(budgets)]
    for name, folders in groups:
        full, cells = group_rows(folders)
        best = {b: min((m for (_, bb), (m, _) in cells.items() if bb == b), default=None) for b in budgets}
        labels = sorted({label for label, _ in cells}, key=lambda x: (ORDER + (x,)).index(x))
        for i, label in enumerate(labels):
            head = f"| {name} | {full['metrics']['n']} | {full['metrics']['ppl']:.2f} |" if i == 0 else "| | | |"
            row = []
            for b in budgets:
                if (label, b) not in cells:
                    row.append("—")
                    continue
                mean, half = cells[(label, b)]
                text = f"{mean:+.4f}{plus_minus(half, 4)}"
                row.append(f"**{text}**" if mean == best[b] and len(labels) > 1 else text)
            lines.append(f"{head} {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="+", metavar="LABEL=DIR[,DIR...]")
    args = p.parse_args(argv)
    groups = []
    for spec in args.groups:
        name, sep, dirs = spec.rpartition("=")
        if not sep or not name or not dirs:
            p.error(f"groups: {spec!r} is not LABEL=DIR[,DIR...]")
        folders = [Path(d) for d in dirs.split(",")]
        missing = [str(f) for f in folders if not (f / "results.jsonl").is_file()]
        if missing:
            p.error(f"groups: no results.jsonl in {', '.join(missing)}")
        groups.append((name, folders))
    try:
        print(table(groups))
    except ValueError as e:
        print(f"peer_table: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
