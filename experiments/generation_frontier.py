"""The compression frontier of a generated task: right answers against the KV held, measured, prompt included.

Each ``eval --out`` folder's rows of one generated task (humaneval, humaneval-chat, mbpp, gsm8k) are placed by
what they measured: the tokens each cache saw over the tokens it held at the end of each answer (per budgeted
layer, prompt included: ``metrics.measured_compression``), against the share of right answers. Each row is paired
with the full cache over the same problems (difference, 95% interval, lost/gained, McNemar's exact p) and with a
reference row (``--against``, by its label) where both answered the same problems. Rows written before the
tokens held were measured are left out, and said so.

    python experiments/generation_frontier.py docs/results/humaneval/q05_chat --task humaneval-chat \\
        --against "scissorhands budget 140" --plot frontier.png

Prints a Markdown table, most compression last; ``--plot`` draws pass rate against measured compression with
95% intervals and the full cache's rate as a line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.eval.report import row_labels
from scissorhands.tools.stats import mcnemar_p, paired_difference, plus_minus

VERDICTS = ("passed", "correct")


def verdicts(row: dict, full: bool = False) -> list[float]:
    """Each problem's verdict in ``row`` (1 right, 0 wrong), or the full cache's paired with it."""
    scores = row["item_scores"]
    name = next(v for v in VERDICTS if v in scores[0])
    return [float(s[f"full_{name}" if full else name]) for s in scores]


def labelled(rows: list[dict]) -> list[tuple[str, dict]]:
    """Each row with a label: its method and budget, then its prefill, its kept prompt and protected structure
    where set, then any other setting that sets it apart from the other rows of its method."""
    out = []
    for label, r in zip(row_labels(rows), rows):
        c = r["config"]
        parts = [f"budget {r['budget']}"]
        if c.get("prefill") not in (None, "stream"):
            parts.append(str(c["prefill"]) + (f" {c['prompt_keep']}" if c.get("prompt_keep") is not None else ""))
        structure = r["key"]["task"].get("structure")
        if structure:  # True: the default parts (asked, turns); else the parts named
            parts.append("structure protected" + ("" if structure is True else f" ({structure})"))
        rest = label[len(r["method"]):].strip(" ()")
        rest = ", ".join(x for x in rest.split(", ") if x and not x.startswith(("prefill=", "prompt_keep=")))
        out.append((f"{r['method']} {', '.join(parts + ([rest] if rest else []))}", r))
    return out


def pair(a: list[float], b: list[float]) -> str:
    diff, half = paired_difference(a, b)
    lost = sum(1 for x, y in zip(a, b) if y and not x)
    gained = sum(1 for x, y in zip(a, b) if x and not y)
    return f"{diff:+.2f}{plus_minus(half, 2)} ({lost} / {gained}, p = {mcnemar_p(lost, gained):.2g})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+", help="eval --out folders")
    p.add_argument("--task", required=True, help="humaneval, humaneval-chat, mbpp or gsm8k")
    p.add_argument("--against", default=None, metavar="LABEL", help="the row every other is paired with")
    p.add_argument("--plot", type=Path, default=None, help="a PNG of the frontier")
    args = p.parse_args(argv)
    rows = [r for f in args.folders for r in load_results(f / "results.jsonl") if r["task"] == args.task]
    if not rows:
        p.error(f"task: no rows of {args.task!r} in {', '.join(map(str, args.folders))}")
    measured = [r for r in rows if r["method"] != "full" and "measured_compression" in r["metrics"]]
    skipped = sum(1 for r in rows if r["method"] != "full" and "measured_compression" not in r["metrics"])
    if not measured:
        p.error("task: no row with measured compression (rows written before it was measured hold none)")
    named = sorted(labelled(measured), key=lambda x: (x[1]["metrics"]["n"], x[1]["metrics"]["measured_compression"]))
    ref = next((r for label, r in named if label == args.against), None)
    if args.against is not None and ref is None:
        p.error(f"against: no row labelled {args.against!r}; the labels are: " + "; ".join(lab for lab, _ in named))
    print(f"| cache | problems | measured compression | tokens held / seen | {args.task} | full | against full "
          f"(lost / gained, McNemar p) |" + (" against the reference |" if ref is not None else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if ref is not None else ""))
    for label, r in named:
        m = r["metrics"]
        mine, full = verdicts(r), verdicts(r, full=True)
        cells = [label, str(m["n"]), f"{m['measured_compression']:.2f}x",
                 f"{m['kv_held_mean']:.0f} / {m['kv_seen_mean']:.0f}", f"{sum(mine) / len(mine):.3f}",
                 f"{sum(full) / len(full):.3f}", pair(mine, full)]
        if ref is not None:
            theirs = verdicts(ref)
            cells.append("" if r is ref else pair(mine, theirs) if len(theirs) == len(mine) else "other problems")
        print("| " + " | ".join(cells) + " |")
    if skipped:
        print(f"\n{skipped} rows without measured compression left out", file=sys.stderr)
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 5))
        for label, r in named:
            m = r["metrics"]
            ax.errorbar(m["measured_compression"], m[r["metric"]], yerr=1.96 * m["acc_stderr"], fmt="o", capsize=3,
                        label=f"{label} (n={m['n']})")
        full_rate = named[0][1]["metrics"][f"full_{named[0][1]['metric']}"]
        ax.axhline(full_rate, color="grey", linestyle="--", label=f"full cache ({full_rate:.2f})")
        ax.set_xlabel("KV compression, measured (tokens seen / tokens held, prompt included)")
        ax.set_ylabel(named[0][1]["metric"])
        ax.set_title(f"{args.task}: {named[0][1]['model']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
