"""Build the measured frontier that ``memory=`` chooses from: ΔNLL against the token budget, per store.

It reads the eviction × bits grid (docs/appendix/results_log.md, "Eviction and low-bit K/V together": SmolLM2-135M,
bf16, Shakespeare, T = 2,048, 8 windows). It keeps the stores that need no calibration file, and writes
one curve per store: the token budget as a fraction of the sequence, and the measured mean ΔNLL.

    python experiments/frontier_data.py src/scissorhands/core/data/frontier.json \
        --grid docs/results/kvbits/grid.jsonl \
        --demotion docs/results/memory docs/results/demotion/8to4 docs/results/demotion/8to4_40
    python experiments/frontier_data.py src/scissorhands/core/data/frontier_qwen2.json \
        --eval docs/results/qwen/q05_prose_2k docs/results/qwen/q05_prose_2k docs/results/qwen/frontier/* \
        --measured-on Qwen2.5-Coder-0.5B

2-bit values without a residual lose more than 1.6 nats at every budget, so they are left out.

Rows measured with key centres are left out, except rotary ones (``scissorhands calibrate``'s format 2):
those make a curve of their own, marked ``"key_centers": "rotary"``, which ``memory=`` considers only when
the settings bring a rotary centre file.

``--eval FULL RUN...`` reads every store's curve from eval runs instead (a model family's own frontier,
``data/frontier_<model_type>.json``). ``--demotion FULL RUN...`` adds one curve per demotion store
(``kv_demote``) found in the ``eval --out`` folders RUN, each row's ΔNLL paired against FULL's full-cache
row on the same windows. Those were measured in float32 (docs/appendix/results_log.md, "Demotion before eviction");
the grid's ΔNLL in bf16 matches the float32 rows of ``memory=`` within 0.001, so the curves are comparable.
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
    p.add_argument("out", type=Path, help="the frontier file to write")
    p.add_argument("--grid", type=Path, default=None, help="the eviction × bits grid (bf16, SmolLM2-135M)")
    p.add_argument("--eval", type=Path, nargs="+", default=None, metavar="DIR",
                   help="FULL then RUN folders: one curve per store found in eval runs, against FULL's full row")
    p.add_argument("--demotion", type=Path, nargs="+", default=None, metavar="DIR",
                   help="FULL then RUN folders: only the demotion curves of eval runs, against FULL's full row")
    p.add_argument("--measured-on", default="SmolLM2-135M", help="the model the curves were measured on")
    args = p.parse_args(argv)
    if args.grid is None and args.eval is None:
        p.error("give --grid, --eval, or both")
    families: list[dict] = []
    sources = []
    if args.grid is not None:
        families += grid_families(args.grid)
        sources.append(f"{args.grid}: SmolLM2-135M, bf16, Shakespeare, T = 2,048, 8 windows, shipped eviction "
                       "defaults, groups of 32 channels")
    for option, only_demotion in (("eval", False), ("demotion", True)):
        folders = getattr(args, option)
        if not folders:
            continue
        if len(folders) < 2:
            p.error(f"--{option}: give the full-cache folder, then at least one run folder")
        families += eval_families(folders[0], folders[1:], only_demotion)
        sources.append(("demotion: " if only_demotion else "") + ", ".join(str(d) for d in folders[1:])
                       + f" (paired against {folders[0]})")
    record = {"format": "scissorhands-frontier/1", "measured_on": args.measured_on, "source": "; ".join(sources),
              "families": families}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def grid_families(grid: Path) -> list[dict]:
    """The grid's curves, one per store of :data:`FAMILIES`."""
    points: dict = defaultdict(dict)
    for line in grid.read_text().splitlines():
        row = json.loads(line)
        if row["name"] in FAMILIES and not row["settings"].get("kv_key_centers"):
            points[row["name"]][float(row["budget"])] = round(float(row["delta_nll"]), 5)
    points["kv16"].setdefault(1.0, 0.0)  # the full cache itself
    families = []
    for name, (label, bits, key_bits, residual) in FAMILIES.items():
        curve = sorted(points[name].items())
        families.append({"name": name, "label": label, "kv_bits": bits, "kv_key_bits": key_bits,
                         "kv_residual": residual, "points": [[f, d] for f, d in curve]})
    return families


def eval_families(full_dir: Path, runs: list[Path], only_demotion: bool = False) -> list[dict]:
    """One curve per store in ``runs``: (token budget / length, paired mean ΔNLL against ``full_dir``)."""
    from scissorhands.core.stores.centers import centers_frame
    from scissorhands.tools.eval.records import load_results
    from scissorhands.tools.stats import paired_difference

    full = next(r for r in load_results(full_dir / "results.jsonl") if r["task"] == "ppl" and r["method"] == "full")
    reference = [float(x["nll"]) for x in full["item_scores"]]
    curves: dict = {}
    for run in runs:
        for r in load_results(run / "results.jsonl"):
            cfg = r["config"]
            centres = cfg.get("kv_key_centers")
            rotary = bool(centres) and centers_frame(centres) == "rotary"
            if r["task"] != "ppl" or r["method"] != "scissorhands" or r.get("memory_choice") \
                    or (centres and not rotary):
                continue
            chain = tuple((int(b), float(x)) for b, x in cfg.get("kv_demote") or ())
            if only_demotion and not chain:
                continue
            bits = cfg.get("kv_bits") if cfg.get("kv_bits") and cfg["kv_bits"] < 16 else None
            key = (bits, cfg.get("kv_key_bits"), cfg.get("kv_residual") if bits else 0, chain, rotary)
            items = [float(x["nll"]) for x in r["item_scores"]]
            if len(items) != len(reference):
                raise SystemExit(f"{run}: {len(items)} windows against the full row's {len(reference)}")
            delta, _ = paired_difference(items, reference)
            curves.setdefault(key, {})[round(r["mean_budget"] / r["mean_length"], 6)] = round(delta, 5)
    out = []
    for (bits, key_bits, residual, chain, rotary), points in curves.items():
        if bits is None:
            points.setdefault(1.0, 0.0)  # the full cache itself
        r = 32 if bits and residual is None else residual  # None: the default residual of a packed store
        name = ("kv16" if bits is None else f"kv{bits}" if key_bits is None else f"k{key_bits}v{bits}") + \
            (f"r{r}" if r else "") + ("d" + "-".join(f"{b}x{x:g}" for b, x in chain) if chain else "")
        label = "16-bit (eviction alone)" if bits is None else \
            (f"{bits}-bit" if key_bits is None else f"{key_bits}-bit keys, {bits}-bit values") + \
            (f", residual {r}" if r else "")
        if chain:
            label = ", ".join(f"{b}-bit for {x:g} of the budget" for b, x in chain) + f", then {label} (demotion)"
        family = {"name": name, "label": label, "kv_bits": bits, "kv_key_bits": key_bits, "kv_residual": residual,
                  "points": [[f, d] for f, d in sorted(points.items())]}
        if chain:
            family["kv_demote"] = [list(t) for t in chain]
        if rotary:
            family.update(name=name + "_rotary", label=label + ", rotary key centres", key_centers="rotary")
        out.append(family)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
