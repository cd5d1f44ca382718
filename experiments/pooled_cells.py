"""One cell's answers gathered from runs over consecutive slices of a task's problems, paired with the full cache
and with each other cell over the same problems.

A cell run on the first 50 problems (``--limit 50``) and again on the next 50 (``--text`` a file of those) is two
rows in two folders; their verdicts, and the full cache's paired with each, joined in order, are the cell over the
first 100. Each part is ``FOLDER#LABEL`` (the label ``generation_frontier.py`` prints for the row; the folder
alone where it holds one row besides the full cache's) with an optional ``@N``: the row's first N problems only
(a row over more problems than the other parts).

    python experiments/pooled_cells.py --task gsm8k --cell defaults docs/results/gsm8k/q15_vllm_ends@100 \\
        --cell forms docs/results/gsm8k/q15_vllm_forms docs/results/gsm8k/q15_vllm_forms_51_100

Prints each cell's rate against the full cache's (difference, 95% interval, lost / gained, McNemar's exact p), then
each pair of cells the same way (the first against the second). The cells must cover the same number of problems.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path

from scissorhands.tools.eval.records import load_results

_spec = importlib.util.spec_from_file_location("generation_frontier",
                                               Path(__file__).with_name("generation_frontier.py"))
frontier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(frontier)


def part(given: str, task: str) -> tuple[list[float], list[float]]:
    """The verdicts of ``FOLDER[#LABEL][@N]`` and the full cache's paired with them (no label: the folder's one
    row besides the full cache's)."""
    head, _, first = given.rpartition("@")
    if not head or not first.isdigit() or int(first) < 1:  # no "@N" (a folder may hold an "@" of its own)
        head, first = given, ""
    folder, _, label = head.partition("#")
    rows = [r for r in load_results(Path(folder) / "results.jsonl") if r["task"] == task and r["method"] != "full"]
    named = dict(frontier.labelled(rows))
    if not label and len(named) == 1:
        label = next(iter(named))
    if not label:
        raise SystemExit(f"cell: {folder} holds {len(named)} rows of {task} besides the full cache's; name one "
                         "(FOLDER#LABEL): " + "; ".join(named))
    if label not in named:
        raise SystemExit(f"cell: no row labelled {label!r} in {folder}; the labels are: " + "; ".join(named))
    n = int(first) if first else None
    return frontier.verdicts(named[label])[:n], frontier.verdicts(named[label], full=True)[:n]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, help="humaneval, humaneval-chat, mbpp or gsm8k")
    p.add_argument("--cell", nargs="+", action="append", required=True, metavar=("NAME", "FOLDER[#LABEL][@N]"),
                   help="a name, then the rows that make the cell, in problem order")
    args = p.parse_args(argv)
    cells = {}
    for name, *parts in args.cell:
        if not parts:
            p.error(f"cell: {name!r} names no row")
        mine, full = [], []
        for given in parts:
            a, b = part(given, args.task)
            mine += a
            full += b
        cells[name] = (mine, full)
    sizes = {len(m) for m, _ in cells.values()}
    if len(sizes) != 1:
        p.error("cell: the cells cover different numbers of problems: " +
                ", ".join(f"{k} {len(m)}" for k, (m, _) in cells.items()))
    fulls = {tuple(f) for _, f in cells.values()}
    if len(fulls) != 1:  # the same problems in the same order answer the same under the full cache
        p.error("cell: the full cache's verdicts differ between the cells: are their slices the same problems, "
                "in the same order?")
    print(f"| cell | problems | {args.task} | full | against full (lost / gained, McNemar p) |")
    print("|---|---|---|---|---|")
    for name, (mine, full) in cells.items():
        print(f"| {name} | {len(mine)} | {sum(mine) / len(mine):.3f} | {sum(full) / len(full):.3f} | "
              f"{frontier.pair(mine, full)} |")
    if len(cells) > 1:
        print("\n| cell | against | difference (lost / gained: the second right and the first not, the other way; "
              "McNemar p) |\n|---|---|---|")
        for (a, (ma, _)), (b, (mb, _)) in itertools.combinations(cells.items(), 2):
            print(f"| {a} | {b} | {frontier.pair(ma, mb)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
