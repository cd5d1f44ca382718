"""Turn measured per-layer sensitivity into a per-layer budget schedule (JSON for ``--schedule``).

Input: the JSONL of ``defaults_sweep.py`` runs named "only layers A-B at N", each compressing one group
of layers alone (every other layer keeps the whole sequence). A group's weight is
``floor + dNLL_group / mean(dNLL)``; every layer of the group gets it. The schedule is relative:
``scissorhands`` rescales a JSON schedule to the total of the budget it is used with.

    python experiments/sensitivity_schedule.py docs/results/sweep2/layers.jsonl --floor 0.25 \
        --out docs/results/sweep2/sensitivity_schedule.json
"""

import argparse
import json
import re
from pathlib import Path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs")
    p.add_argument("--floor", type=float, default=0.25)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    groups = []
    for line in Path(args.runs).read_text().splitlines():
        rec = json.loads(line)
        m = re.match(r"only layers (\d+)-(\d+) at", rec["name"])
        if m:
            groups.append((int(m.group(1)), int(m.group(2)), max(rec["delta_nll"], 0.0)))
    mean = sum(d for *_, d in groups) / len(groups)
    n_layers = max(b for _, b, _ in groups) + 1
    weights = [0.0] * n_layers
    for a, b, d in groups:
        for i in range(a, b + 1):
            weights[i] = args.floor + d / mean
    budgets = [max(1, round(1000 * w)) for w in weights]
    Path(args.out).write_text(json.dumps({
        "budgets": budgets,
        "source": f"per-group dNLL when only that group is compressed ({args.runs}); weight = {args.floor} + "
                  "dNLL / mean dNLL; relative, rescaled to the budget's total when used",
        "group_delta_nll": [[a, b, d] for a, b, d in groups]}, indent=1) + "\n")
    print(budgets)


if __name__ == "__main__":
    main()
