"""Build the measured frontier that ``memory=`` chooses from: ΔNLL against the token budget, per store.

It reads the eviction × bits grid (docs/results.md, "Eviction and low-bit K/V together": SmolLM2-135M,
bf16, Shakespeare, T = 2,048, 8 windows). It keeps the stores that need no calibration file, and writes
one curve per store: the token budget as a fraction of the sequence, and the measured mean ΔNLL.

    python experiments/frontier_data.py docs/results/kvbits/grid.jsonl src/scissorhands/core/data/frontier.json \
        --demotion docs/results/memory docs/results/demotion/8to4

2-bit values without a residual lose more than 1.6 nats at every budget, so they are left out.

``--demotion FULL RUN...`` adds one curve per demotion store (``kv_demote``) found in the ``eval --out``
folders RUN, each row's ΔNLL paired against FULL's full-cache row on the same windows. Those were measured
in float32 (docs/results.md, "Demotion before eviction"); the grid's ΔNLL in bf16 matches the float32
rows of ``memory=`` within 0.001, so the curves are comparable.
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
    p.add_argument("--demotion", type=Path, nargs="+", default=None, metavar="DIR",
                   help="FULL then RUN folders: demotion curves from eval runs, against FULL's full-cache row")
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
    source = ("docs/results/kvbits/grid.jsonl: SmolLM2-135M, bf16, Shakespeare, T = 2,048, 8 windows, "
              "shipped eviction defaults, groups of 32 channels")
    if args.demotion:
        if len(args.demotion) < 2:
            p.error("--demotion: give the full-cache folder, then at least one run folder")
        families += demotion_families(args.demotion[0], args.demotion[1:])
        source += "; demotion: " + ", ".join(str(d) for d in args.demotion[1:]) + " (float32, paired)"
    record = {"format": "scissorhands-frontier/1", "source": source, "families": families}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def demotion_families(full_dir: Path, runs: list[Path]) -> list[dict]:
    """One curve per demotion chain in ``runs``: (token budget / length, paired mean ΔNLL) per row."""
    from scissorhands.tools.eval.runner import load_results
    from scissorhands.tools.stats import paired_difference

    full = next(r for r in load_results(full_dir / "results.jsonl") if r["task"] == "ppl" and r["method"] == "full")
    reference = [float(x["nll"]) for x in full["item_scores"]]
    curves: dict = {}
    for run in runs:
        for r in load_results(run / "results.jsonl"):
            cfg = r["config"]
            if r["task"] != "ppl" or not cfg.get("kv_demote"):
                continue
            chain = tuple((int(b), float(x)) for b, x in cfg["kv_demote"])
            key = (cfg["kv_bits"], chain, cfg.get("kv_residual"))
            delta, _ = paired_difference([float(x["nll"]) for x in r["item_scores"]], reference)
            curves.setdefault(key, {})[round(r["mean_budget"] / r["mean_length"], 6)] = round(delta, 5)
    out = []
    for (bits, chain, residual), points in curves.items():
        name = f"kv{bits}d" + "-".join(f"{b}x{x:g}" for b, x in chain)
        label = ", ".join(f"{b}-bit for {x:g} of the budget" for b, x in chain) + f", then {bits}-bit (demotion)"
        out.append({"name": name, "label": label, "kv_bits": bits, "kv_key_bits": None, "kv_residual": residual,
                    "kv_demote": [list(t) for t in chain], "points": [[f, d] for f, d in sorted(points.items())]})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
