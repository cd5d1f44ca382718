"""Do the two engines write the same answers? The rows of one generated task from two ``eval --out`` folders
(typically one run with ``--engine transformers``, one with ``--engine vllm``), matched by method, budget and
settings, compared problem by problem over the problems both answered: the same completion, the same verdict.

    python experiments/engine_agreement.py docs/results/humaneval/q05_chat_rounds \\
        docs/results/humaneval/q05_chat_vllm --task humaneval-chat

Prints a Markdown table: one line per pair of rows with the same settings, the problems compared, the answers
written token for token the same, the verdicts the same, and each side's right answers on those problems.
Settings are compared as recorded (``config``); the engine itself is the one difference allowed.
``--engine vllm`` records ``rounds`` on, so a transformers row matches it when it ran in rounds too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scissorhands.tools.eval.records import load_results

VERDICTS = ("passed", "correct")


def _settings(row: dict) -> tuple:
    """What must agree for two rows to be the same cache: the method, the budget and every recorded setting (the
    full cache's settings change nothing it keeps, so its rows match by method alone)."""
    if row["method"] == "full":
        return ("full",)
    key = {k: v for k, v in row.get("key", {}).items() if k not in ("engine", "limit", "n_items")}
    return row["method"], row["budget"], tuple(sorted((row.get("config") or {}).items())), repr(sorted(key.items()))


def compare(a: dict, b: dict) -> dict:
    """The problems both rows answered (the first ``n`` of each), and how many agree."""
    xs, ys = a["item_scores"], b["item_scores"]
    n = min(len(xs), len(ys))
    name = next(v for v in VERDICTS if v in xs[0])
    return {"n": n,
            "same_answer": sum(x["completion"] == y["completion"] for x, y in zip(xs[:n], ys[:n])),
            "same_verdict": sum(bool(x[name]) == bool(y[name]) for x, y in zip(xs[:n], ys[:n])),
            "right_a": sum(bool(x[name]) for x in xs[:n]), "right_b": sum(bool(y[name]) for y in ys[:n])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="an eval --out folder (or its results.jsonl)")
    parser.add_argument("second", type=Path, help="another, run with the other engine")
    parser.add_argument("--task", required=True, help="the generated task whose rows are compared")
    args = parser.parse_args(argv)
    sides = []
    for folder in (args.first, args.second):
        path = folder / "results.jsonl" if folder.is_dir() else folder
        if not path.is_file():
            parser.error(f"{folder}: no results.jsonl there")
        sides.append([r for r in load_results(path) if r["task"] == args.task and r.get("item_scores")])
    print("| method | budget | problems | same answer | same verdict | right (first) | right (second) |")
    print("|---|---|---|---|---|---|---|")
    matched = 0
    for a in sides[0]:
        for b in sides[1]:
            if _settings(a) != _settings(b):
                continue
            c = compare(a, b)
            matched += 1
            print(f"| {a['method']} | {a['budget'] or 'full'} | {c['n']} | {c['same_answer']} "
                  f"({c['same_answer'] / c['n']:.0%}) | {c['same_verdict']} ({c['same_verdict'] / c['n']:.0%}) | "
                  f"{c['right_a']} | {c['right_b']} |")
    if not matched:
        print(f"no rows of {args.task} with the same settings in both folders", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
