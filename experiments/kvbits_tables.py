"""Markdown tables for the eviction x quantisation grid, from a ``defaults_sweep.py`` JSONL (settings named by bits).

Quality: ΔNLL against the bf16 full cache, paired over windows. Memory: the
measured bytes of the cache that scored the first window, against what a bf16
full cache holds for the same tokens (1.0 for the bf16 full cache itself).
Compounding: each window's loss of the combination minus the sum of the two
separate losses (eviction alone at that budget, quantisation alone without
eviction), mean and 95% interval over windows.

    python experiments/kvbits_tables.py docs/results/kvbits/grid.jsonl
    python experiments/kvbits_tables.py --fewshot docs/results/kvbits/fewshot/results.jsonl

With ``--fewshot`` it reads ``scissorhands eval`` records instead: accuracy per
cell (bits x budget; the ``full`` method is budget 1.0) and its change against
the bf16 full cache of the same file, paired over the same questions, per task
and pooled over the tasks, with the K/V reduction measured by the eval.
"""

import argparse
import json
from pathlib import Path

from scissorhands.tools.stats import mean_ci

LABELS = {"kv16": "16 (bf16)", "kv8": "8", "k8v4": "K 8 / V 4", "kv4r32": "4, residual 32", "kv4r16": "4, residual 16",
          "kv4cr16": "4, keys centred, residual 16", "k4v2r16": "K 4 / V 2, residual 16",
          "kv4c16": "4, keys centred, groups of 16", "kv4c": "4, keys centred", "kv4": "4", "k8v2": "K 8 / V 2",
          "kv2": "2"}


def load(path):
    cells = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        cells[(r["name"], r["budget"])] = r
    full = json.loads(Path(path).with_suffix(".full.json").read_text())["nll"]
    return cells, full


def reductions(r):
    m = r.get("memory")
    if m is None:  # a DynamicCache in the model's dtype (bf16): the reference itself
        return 1.0, 1.0
    return m["kv_reduction_vs_bf16"], m["total_reduction_vs_bf16"]


def main(path):
    cells, full = load(path)
    names = [n for n in LABELS if any(k[0] == n for k in cells)]
    budgets = sorted({b for _, b in cells}, reverse=True)
    head = "| bits | " + " | ".join(f"budget {b}" for b in budgets) + " |\n" + "|---" * (len(budgets) + 1) + "|"

    print("ΔNLL against the bf16 full cache (nats/token, 95% interval):\n")
    print(head)
    for n in names:
        row = [cells.get((n, b)) for b in budgets]
        print(f"| {LABELS[n]} | " + " | ".join("" if r is None else f"{r['delta_nll']:+.4f} ±{r['delta_nll_ci95']:.4f}"
                                           for r in row) + " |")

    print("\nMeasured reduction against a bf16 full cache: K/V bytes only / K/V + importance state + positions:\n")
    print(head)
    for n in names:
        row = [cells.get((n, b)) for b in budgets]
        print(f"| {LABELS[n]} | " + " | ".join(
            "" if r is None else "{:.1f}x / {:.1f}x".format(*reductions(r)) for r in row) + " |")

    print("\nCompounding: loss of the combination minus (eviction alone + quantisation alone), paired per window:\n")
    evicting = [b for b in budgets if b < 1.0]
    print("| bits | " + " | ".join(f"budget {b}" for b in evicting) + " |\n" + "|---" * (len(evicting) + 1) + "|")
    for n in names:
        if n == "kv16" or (n, 1.0) not in cells:
            continue
        quant = cells[(n, 1.0)]["nll"]
        vals = []
        for b in evicting:
            combo, evict = cells.get((n, b)), cells.get(("kv16", b))
            if combo is None or evict is None:
                vals.append("")
                continue
            excess = [c - e - q + f for c, e, q, f in zip(combo["nll"], evict["nll"], quant, full)]
            mean, half = mean_ci(excess)
            vals.append(f"{mean:+.4f} ±{half:.4f}")
        print(f"| {LABELS[n]} | " + " | ".join(vals) + " |")


def bits_label(config):
    bits, key = config.get("kv_bits"), config.get("kv_key_bits")
    if bits in (None, 16):
        return "16 (bf16)"
    label = f"K {key} / V {bits}" if key not in (None, bits) else str(bits)
    residual = config.get("kv_residual", 0)  # records made before the residual existed had none
    if residual is None:
        return label + ", residual (default)"
    return label + (f", residual {residual}" if residual else "")


def kv_reduction(r):
    """A bf16 full cache's K/V bytes over this cell's, from the record's lengths, budget and packing."""
    from scissorhands import CacheSettings
    from scissorhands.core.stores.packed import packed_bytes_per_token_head

    c, d = r["config"], r["key"]["model"]["signature"]["head_dim"]
    dense = 2 * d * 2  # K and V in bf16, per token and KV head
    stored = dense if c.get("kv_bits") in (None, 16) else packed_bytes_per_token_head(
        d, d, c["kv_bits"], c.get("kv_key_bits"), c.get("kv_group_size", 32))
    fields = {k: v for k, v in c.items() if k in CacheSettings.__dataclass_fields__}
    fields.setdefault("kv_residual", 0)  # records made before the residual existed had none
    settings = CacheSettings(**fields)
    residual = min(settings.residual_for(round(r["mean_budget"]), evicts=r["method"] != "full"), r["mean_budget"])
    return r["mean_length"] * dense / (r["mean_budget"] * stored + residual * dense)


def fewshot(path):
    recs = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    cells = {}
    for r in recs:
        budget = 1.0 if r["method"] == "full" else r["budget"]
        cells[(bits_label(r["config"]), budget, r["task"])] = r
    ref = {t: cells.get(("16 (bf16)", 1.0, t)) for t in tasks}
    keys = sorted({(b, f) for b, f, _ in cells}, key=lambda k: (list(LABELS.values()).index(k[0])
                                                               if k[0] in LABELS.values() else 9, -k[1]))
    print("| bits | budget | " + " | ".join(f"{t} acc | Δ {t}" for t in tasks)
          + " | Δ pooled | K/V reduction vs bf16 | compounding, pooled |")
    print("|---|---|" + "---|---|" * len(tasks) + "---|---|---|")
    for bits, budget in keys:
        row, pooled, reduction = [], [], []
        for t in tasks:
            r = cells.get((bits, budget, t))
            if r is None:
                row += ["", ""]
                continue
            row.append(f"{r['value']:.3f}")
            reduction.append(kv_reduction(r))
            base = ref[t]
            if base is None or base is r:
                row.append("—")
                continue
            d = [100 * (float(a["correct"]) - float(b["correct"]))
                 for a, b in zip(r["item_scores"], base["item_scores"])]
            pooled += d
            m, h = mean_ci(d)
            row.append(f"{m:+.1f} ±{h:.1f}")
        m, h = mean_ci(pooled) if pooled else (float("nan"), 0.0)
        red = sum(reduction) / len(reduction) if reduction else float("nan")
        print(f"| {bits} | {budget} | " + " | ".join(row) + (f" | {m:+.1f} ±{h:.1f}" if pooled else " | —")
              + f" | {red:.1f}x | {excess(cells, tasks, bits, budget)} |")


def excess(cells, tasks, bits, budget):
    """Compounding, pooled over tasks: per question, combination - eviction alone - quantisation alone + full."""
    if bits == "16 (bf16)" or budget == 1.0:
        return "—"
    d = []
    for t in tasks:
        parts = [cells.get(k) for k in ((bits, budget, t), ("16 (bf16)", budget, t), (bits, 1.0, t),
                                         ("16 (bf16)", 1.0, t))]
        if any(x is None for x in parts):
            return ""
        for c, e, q, f in zip(*(x["item_scores"] for x in parts)):
            d.append(100 * (float(c["correct"]) - float(e["correct"]) - float(q["correct"]) + float(f["correct"])))
    m, h = mean_ci(d)
    return f"{m:+.1f} ±{h:.1f}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Markdown tables for the eviction x quantisation grid.")
    ap.add_argument("path", help="a defaults_sweep.py JSONL (its .full.json beside it), or with --fewshot "
                                 "a scissorhands eval results.jsonl")
    ap.add_argument("--fewshot", action="store_true", help="read scissorhands eval few-shot records")
    args = ap.parse_args()
    if args.fewshot:
        fewshot(args.path)
    else:
        main(args.path)
