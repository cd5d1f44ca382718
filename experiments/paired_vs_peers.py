"""Paired NLL differences between the shipped defaults and each peer method, over the same text windows.

Peers come from the ``scissorhands eval`` results of docs/results/ppl (every method at 2x-10x, 16 windows
of 2,048 tokens, bf16); the defaults from ``defaults_sweep.py`` on the same windows. Negative means the
defaults lose less.

    python experiments/paired_vs_peers.py docs/results/sweep2/final16.jsonl docs/results/ppl/results.jsonl \
        docs/results/sweep/w400-exact/results.jsonl
"""

import argparse
import json
from pathlib import Path

from scissorhands.tools.stats import paired_difference


def main():
    ap = argparse.ArgumentParser(description="Paired NLL differences between the shipped defaults and each peer "
                                             "method, over the same text windows.")
    ap.add_argument("ours", help="the defaults_sweep.py JSONL of the defaults")
    ap.add_argument("peers", nargs="+", help="scissorhands eval results.jsonl files of the peers")
    args = ap.parse_args()
    ours_path, peer_paths = args.ours, args.peers
    ours = {r["budget"]: r["nll"] for r in map(json.loads, Path(ours_path).read_text().splitlines())}
    peers = {}
    for path in peer_paths:
        for r in map(json.loads, Path(path).read_text().splitlines()):
            if r["method"] == "full" or r["task"] != "ppl":
                continue
            name = r["method"] if "w400-exact" not in path else "paper (w = 400 exact)"
            peers[(name, round(r["budget"], 3))] = [s["nll"] for s in r["item_scores"]]
    budgets = sorted(ours, reverse=True)
    names = list(dict.fromkeys(n for n, _ in peers))
    print("| defaults vs | " + " | ".join(f"{1 / b:.0f}x (budget {b:g})" for b in budgets) + " |")
    print("|---" * (len(budgets) + 1) + "|")
    for name in names:
        cells = []
        for b in budgets:
            other = peers.get((name, round(b, 3)))
            if other is None:
                cells.append("")
                continue
            mean, half = paired_difference(ours[b], other)
            cells.append(f"{mean:+.4f} ±{half:.4f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
