"""Build the measured frontier that ``memory=`` chooses from: ΔNLL against the token budget, per store.

It reads the eviction × bits grid (docs/results.md, "Eviction and low-bit K/V together": SmolLM2-135M,
bf16, Shakespeare, T = 2,048, 8 windows). It keeps the stores that need no calibration file, and writes
one curve per store: the token budget as a fraction of the sequence, and the measured mean ΔNLL.

    python experiments/frontier_data.py docs/results/kvbits/grid.jsonl src/scissorhands/core/data/frontier.json

2-bit values without a residual lose more than 1.6 nats at every budget, so they are left out.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# grid name -> (store label, kv_bits, kv_key_bits, kv_residual); the grid's packed rows without a residual
# were run before the residual existed, i.e. with kv_residual=0.
FAMILIES = {
    "kv16": ("16-bit (eviction alone)", None, None, 0),
    "kv8": ("8-bit", 8, None, 0),
    "k8v4": ("8-bit keys, 4-bit values", 4, 8, 0),
    "kv4": ("4-bit", 4, None, 0),
    "kv4r32": ("4-bit, residual 32", 4, None, 32),
    "kv4r16": ("4-bit, residual 16", 4, None, 16),
    "k4v2r16": ("4-bit keys, 2-bit values, residual 16", 2, 4, 16),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grid", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    points = defaultdict(dict)
    for line in args.grid.read_text().splitlines():
        row = json.loads(line)
        if row["name"] in FAMILIES and not row["settings"].get("kv_key_centers"):
            points[row["name"]][float(row["budget"])] = round(float(row["delta_nll"]), 5)
    points["kv16"].setdefault(1.0, 0.0)  # the full cache itself
    families = []
    for name, (label, bits, key_bits, residual) in FAMILIES.items():
        curve = sorted(points[name].items())
        families.append({"name": name, "label": label, "kv_bits": bits, "kv_key_bits": key_bits,
                         "kv_residual": residual, "points": [[f, d] for f, d in curve]})
    record = {"format": "scissorhands-frontier/1",
              "source": "docs/results/kvbits/grid.jsonl: SmolLM2-135M, bf16, Shakespeare, T = 2,048, 8 windows, "
                        "shipped eviction defaults, groups of 32 channels",
              "families": families}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
