"""ΔNLL against the bytes a cache really holds: every store and `memory=` on one Pareto plot.

Each argument after the options is an ``eval --out`` folder of ``ppl`` rows scored on the same windows
as the ``--full`` folder's full-cache row (same text, ``--seq-len``, ``--num-samples`` and ``--seed``).
A row's bytes are its exact peak over the budgeted layers, everything stored counted (K/V, packed or
not, scales and zero-points, the residual, a tiered store's pools and indices, the importance state and
the positions), as :func:`scissorhands.core.planning.memory_target.peak_bytes` computes them and the cache
allocates them (tests/core/test_demotion.py checks the two agree). A row that evicts nothing (the scorer's
packed full cache) keeps no importance state. The full cache counts its K/V alone.

    python experiments/memory_pareto.py --model smollm2-135m --full docs/results/memory \\
        docs/results/memory docs/results/demotion/* --out docs/analysis/memory_pareto.png \\
        --table docs/results/demotion/pareto.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.stats import paired_difference

KINDS = {"eviction": "eviction alone (16-bit)", "bits": "bits alone (no eviction)", "mix": "bits + eviction",
         "memory": "memory= as shipped", "demote": "demotion before eviction"}


def _store(config: dict) -> str:
    bits = config.get("kv_bits")
    if not bits or bits >= 16:
        return "16-bit"
    keys = f"{config['kv_key_bits']}-bit keys / {bits}-bit values" if config.get("kv_key_bits") else f"{bits}-bit"
    demote = config.get("kv_demote")
    if demote:
        keys = " → ".join(f"{b} ({share:g})" for b, share in demote) + f" → {bits}"
    return keys


def rows_of(folder: Path, full_items: list[float], shape, length: int, method: str = "scissorhands") -> list[dict]:
    """Every ppl row of ``method`` in an eval folder, with its exact peak bytes and its ΔNLL against ``full_items``."""
    from scissorhands.core.planning.memory_target import peak_bytes, store_bytes
    from scissorhands.core.settings.config import ScissorhandsConfig

    out = []
    for r in load_results(folder / "results.jsonl"):
        if r["task"] != "ppl" or r["method"] != method:
            continue
        items = [float(s["nll"]) for s in r["item_scores"]]
        if len(items) != len(full_items):
            raise SystemExit(f"{folder}: {len(items)} windows against the full row's {len(full_items)}")
        delta, half = paired_difference(items, full_items)
        config = dict(r["config"])
        if r.get("memory_choice"):
            choice = r["memory_choice"][0]
            held = sum(c["peak_bytes"] for c in r["memory_choice"]) / len(r["memory_choice"])
            kind, budget = "memory", choice["budget"]
            label = f"memory={r['budget'].split('=')[-1]}: {_store(config)}, budget {budget}"
        else:
            budget = round(r["mean_budget"])
            cfg = ScissorhandsConfig(budget=budget, **config)
            quantized = bool(config.get("kv_bits")) and config["kv_bits"] < 16
            kind = ("demote" if config.get("kv_demote") else "eviction" if not quantized
                    else "bits" if budget >= length else "mix")
            # Nothing evicted (the scorer's packed full cache): no importance state, an int32 position per slot.
            held = store_bytes(cfg, shape, evicts=False) + shape.layers * shape.kv_heads * budget * 4 \
                if kind == "bits" else peak_bytes(cfg, shape)
            label = f"{_store(config)}, budget {budget}"
        out.append({"kind": kind, "label": label, "budget": budget, "bytes": held, "delta": delta, "half": half})
    return out


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both bytes and ΔNLL, by bytes."""
    front, best = [], float("inf")
    for r in sorted(rows, key=lambda r: (r["bytes"], r["delta"])):
        if r["delta"] < best:
            front.append(r)
            best = r["delta"]
    return front


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+", help="eval --out folders of ppl rows")
    p.add_argument("--full", type=Path, required=True, help="the eval folder whose full-cache row is the reference")
    p.add_argument("--model", required=True, help="the model the rows were scored on (for its shape and dtype)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--method", default="scissorhands", help="the eviction method whose rows are plotted")
    p.add_argument("--out", type=Path, default=None, help="the plot (.png)")
    p.add_argument("--table", type=Path, default=None, help="the markdown table (default: stdout only)")
    args = p.parse_args(argv)

    from scissorhands.hf.cache import memory_shape
    from scissorhands.tools.models import load_model

    full = next((r for r in load_results(args.full / "results.jsonl") if r["task"] == "ppl" and r["method"] == "full"),
                None)
    if full is None:
        print(f"full: {args.full} holds no full-cache ppl row", file=sys.stderr)
        return 2
    model, _ = load_model(args.model, dtype=args.dtype)
    shape = memory_shape(model)
    length = round(full["mean_length"])
    full_items = [float(s["nll"]) for s in full["item_scores"]]
    full_bytes = full["full_kv_bytes"]
    rows = [r for folder in dict.fromkeys(args.folders)
            for r in rows_of(folder, full_items, shape, length, args.method)]
    front = {id(r) for r in pareto(rows)}
    lines = ["| kind | store, token budget | bytes held | of the full cache | ΔNLL vs full | on the front |",
             "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["bytes"]):
        lines.append(f"| {KINDS[r['kind']]} | {r['label']} | {r['bytes'] / 2**20:.2f} MiB | "
                     f"1/{full_bytes / r['bytes']:.1f} | {r['delta']:+.4f} ±{r['half']:.4f} | "
                     f"{'yes' if id(r) in front else ''} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        # Rows far above the rest (2-bit K/V alone, or 4-bit keys on Qwen) would flatten the chart: they are
        # listed in a box instead.
        tame = sorted(r["delta"] for r in rows)
        cut = 4 * tame[len(tame) // 2] + 0.05
        top = max(0.01, 1.25 * max((r["delta"] + r["half"] for r in rows if r["delta"] < cut), default=cut))
        shown = [r for r in rows if r["delta"] <= top]
        for kind, name in KINDS.items():
            mine = [r for r in shown if r["kind"] == kind]
            if mine:
                ax.errorbar([full_bytes / r["bytes"] for r in mine], [r["delta"] for r in mine],
                            yerr=[r["half"] for r in mine], fmt="o", capsize=3, label=name)
        line = sorted((r for r in shown if id(r) in front), key=lambda r: r["bytes"])
        ax.plot([full_bytes / r["bytes"] for r in line], [r["delta"] for r in line], "k--", lw=0.8,
                label="Pareto front")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"1/{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks([2, 3, 5, 10, 20, 40])
        off = [r for r in rows if r["delta"] > top]
        if off:
            text = "off the chart:\n" + "\n".join(f"1/{full_bytes / r['bytes']:.0f} {r['label']}: {r['delta']:+.2f}"
                                                   for r in sorted(off, key=lambda r: r["bytes"], reverse=True))
            ax.text(0.99, 0.98, text, transform=ax.transAxes, ha="right", va="top", fontsize=7,
                    bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
        ax.set_ylim(min(-0.005, min(r["delta"] - r["half"] for r in shown)), top)
        ax.set_xlabel("bytes held, as a fraction of the full cache (everything stored counted)")
        ax.set_ylabel("ΔNLL vs the full cache (nats/token)")
        ax.set_title(f"{args.model} ({args.dtype}), T = {length}, {len(full_items)} windows")
        ax.axhline(0, color="grey", lw=0.5)
        ax.legend(fontsize=8)
        fig.tight_layout()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=120)
        print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
