"""How GSM8K answers fail under eviction: the worked examples' answer form lost, or the sum.

Reads the GSM8K rows of ``eval --out`` folders and, for each, counts over its problems: the answers that never
write "the answer is" (the form every worked example ends in, "So the answer is N."), those that run to the
answer limit, and among the problems the full cache gets right and the row gets wrong (lost), those whose text
holds the right number somewhere all the same (the sum done, the form lost: the judge reads the number after
"the answer is", else the last number) and those that drift into a code block. Every row is read against the
full row of its own folder.

    python experiments/answer_forms.py docs/results/gsm8k/q15_vllm_ends docs/results/gsm8k/q15_vllm_recent

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.eval.report import row_labels

FORM = "the answer is"
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def numbers(text: str) -> set[str]:
    """The numbers a text writes, commas and a closing point dropped."""
    return {n.replace(",", "").rstrip(".") for n in _NUMBER.findall(text)}


def describe(row: dict, full: dict, limit: int) -> dict:
    """The counts of the module docstring for ``row``, against ``full`` over the same first problems."""
    mine, theirs = row["item_scores"], full["item_scores"][: len(row["item_scores"])]
    lost = [(a, b) for a, b in zip(mine, theirs) if b["correct"] and not a["correct"]]
    return {
        "n": len(mine),
        "right": int(sum(a["correct"] for a in mine)),
        "no_form": sum(FORM not in a["completion"].lower() for a in mine),
        "at_limit": sum(a["new_tokens"] >= limit for a in mine),
        "lost": len(lost),
        "lost_number_there": sum(str(b["answer"]) in numbers(a["completion"]) for a, b in lost),
        "lost_code": sum("```" in a["completion"] for a, _ in lost),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    args = ap.parse_args(argv)
    print("| folder | row | problems | right | answers without the form | at the limit | lost | lost, the right "
          "number written | lost, a code block |")
    print("|---|---|---|---|---|---|---|---|---|")
    for folder in args.folders:
        rows = [r for r in load_results(folder / "results.jsonl") if r["task"] == "gsm8k"]
        fulls = [r for r in rows if r["method"] == "full"]
        if not fulls:
            print(f"{folder}: no full row to read the rows against", file=sys.stderr)
            continue
        full = max(fulls, key=lambda r: len(r["item_scores"]))
        labels = row_labels(rows)
        for row, label in zip(rows, labels):
            d = describe(row, full, row["key"]["task"].get("max_new_tokens", 256))
            print(f"| {folder.name} | {label} | {d['n']} | {d['right']} | {d['no_form']} | {d['at_limit']} | "
                  f"{d['lost']} | {d['lost_number_there']} | {d['lost_code']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
