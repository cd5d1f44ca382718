"""Markdown tables and plots for docs/results.md from the eval grid's JSONL.

    python benchmarks/results_tables.py docs/results/ppl docs/results/fewshot > docs/results_tables.md
"""

import sys
from pathlib import Path

from scissorhands.tools.eval.runner import load_results, paired_vs_full, plot_results


def ppl_table(results):
    recs = [r for r in results if r["task"] == "ppl"]
    if not recs:
        return ""
    full = next((r for r in recs if r["method"] == "full"), None)
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None}, reverse=True)
    methods = list(dict.fromkeys(r["method"] for r in recs if r["method"] != "full"))
    by = {(r["method"], r["budget"]): r for r in recs}
    paired = {(p["method"], p["budget"]): p for p in paired_vs_full(results)}
    comp = {b: next(r["compression"] for r in recs if r["budget"] == b) for b in budgets}
    lines = ["Perplexity (95% CI over windows); below it, the mean NLL change against the full cache, paired "
             "over the same windows (95% CI). Lower is better.", ""]
    lines.append("| method | " + " | ".join(f"{comp[b]:.1f}x (budget {b})" for b in budgets) + " |")
    lines.append("|---|" + "---|" * len(budgets))
    if full:
        lo, hi = full["metrics"]["ppl_ci95"]
        lines.append("| full (1x) | " + " | ".join(f"{full['metrics']['ppl']:.2f} [{lo:.2f}, {hi:.2f}]"
                                                    for _ in budgets) + " |")
    for m in methods:
        cells = []
        for b in budgets:
            r = by.get((m, b))
            if r is None:
                cells.append("not run")
                continue
            lo, hi = r["metrics"]["ppl_ci95"]
            p = paired.get((m, b))
            delta = f"<br>ΔNLL {p['delta_nll']:+.3f} ±{p['delta_nll_ci95']:.3f}" if p else ""
            cells.append(f"{r['metrics']['ppl']:.2f} [{lo:.2f}, {hi:.2f}]{delta}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    n = full["n_items"] if full else recs[0]["n_items"]
    lines.append("")
    lines.append(f"{n} windows of {int(recs[0]['mean_length'])} tokens, the same windows for every method.")
    return "\n".join(lines)


def fewshot_table(results):
    recs = [r for r in results if r["task"] not in ("ppl", "agreement")]
    if not recs:
        return ""
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    rows = list(dict.fromkeys((r["method"], r["budget"]) for r in recs))
    by = {(r["method"], r["budget"], r["task"]): r for r in recs}
    lines = ["acc / acc_norm (± standard error of acc); budget is a fraction of each question's own length "
             "(context + longest choice).", ""]
    lines.append("| method | budget | " + " | ".join(tasks) + " | mean acc |")
    lines.append("|---|---|" + "---|" * (len(tasks) + 1))
    for m, b in rows:
        cells, accs = [], []
        for t in tasks:
            r = by.get((m, b, t))
            if r is None:
                cells.append("not run")
                continue
            mm = r["metrics"]
            accs.append(mm["acc"])
            cells.append(f"{mm['acc']:.3f} / {mm['acc_norm']:.3f} ±{mm['acc_stderr']:.3f}")
        mean = f"{sum(accs) / len(accs):.3f}" if len(accs) == len(tasks) else ""
        lines.append(f"| {m} | {'full' if b is None else b} | " + " | ".join(cells) + f" | {mean} |")
    n = {t: next(r["n_items"] for r in recs if r["task"] == t) for t in tasks}
    lines.append("")
    lines.append("Questions per task: " + ", ".join(f"{t} {k}" for t, k in n.items()))
    return "\n".join(lines)


def main():
    out = []
    for d in sys.argv[1:]:
        results = load_results(Path(d) / "results.jsonl")
        if not results:
            continue
        plot_results(results, Path(d))
        for table in (ppl_table(results), fewshot_table(results)):
            if table:
                out.append(table)
    print("\n\n".join(out))


if __name__ == "__main__":
    main()


def paired_between(results, a="scissorhands", task="ppl"):
    """Mean per-window NLL of method ``a`` minus each other method, same windows (95% CI)."""
    from scissorhands.tools.eval.tasks import _mean_ci

    recs = {(r["method"], r["budget"]): r for r in results if r["task"] == task}
    lines = [f"| vs {a} | " + " | ".join(f"budget {b}" for b in sorted({k[1] for k in recs if k[1]}, reverse=True))
             + " |"]
    budgets = sorted({k[1] for k in recs if k[1]}, reverse=True)
    lines.append("|---|" + "---|" * len(budgets))
    for m in dict.fromkeys(k[0] for k in recs):
        if m in ("full", a):
            continue
        cells = []
        for b in budgets:
            if (a, b) not in recs or (m, b) not in recs:
                cells.append("")
                continue
            d = [x["nll"] - y["nll"] for x, y in zip(recs[(a, b)]["item_scores"], recs[(m, b)]["item_scores"])]
            mean, half = _mean_ci(d)
            cells.append(f"{mean:+.4f} ±{half:.4f}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(default_dir, sweep_dir, method="scissorhands", budget=0.2):
    """Each setting of a defaults sweep against the shipped defaults, paired over the same windows."""
    from scissorhands.tools.eval.tasks import _mean_ci

    base = next(r for r in load_results(Path(default_dir) / "results.jsonl")
                if r["method"] == method and r["budget"] == budget and r["task"] == "ppl")
    lines = ["| setting | w | buckets | m | r | importance | ppl | ΔNLL vs defaults (95% CI) |",
             "|---|---|---|---|---|---|---|---|"]
    c = base["config"]
    lines.append(f"| defaults | {c['window']} | {c['window_buckets']} | {c['drop']} | {c['recent']} | "
                 f"{c['importance']} | {base['metrics']['ppl']:.2f} | 0 |")
    for d in sorted(Path(sweep_dir).iterdir()):
        recs = load_results(d / "results.jsonl")
        if not recs:
            continue
        r = recs[0]
        c = r["config"]
        diffs = [x["nll"] - y["nll"] for x, y in zip(r["item_scores"], base["item_scores"])]
        mean, half = _mean_ci(diffs)
        lines.append(f"| {d.name} | {c['window']} | {c['window_buckets']} | {c['drop']} | {c['recent']} | "
                     f"{c['importance']} | {r['metrics']['ppl']:.2f} | {mean:+.4f} ±{half:.4f} |")
    return "\n".join(lines)


def fewshot_paired(results):
    """Accuracy change against the full cache, paired over the same questions (95% CI), per task."""
    from scissorhands.tools.eval.tasks import _mean_ci

    recs = [r for r in results if r["task"] not in ("ppl", "agreement")]
    tasks = list(dict.fromkeys(r["task"] for r in recs))
    full = {r["task"]: r for r in recs if r["method"] == "full"}
    lines = ["| method | budget | " + " | ".join(tasks) + " | all tasks |", "|---|---|" + "---|" * (len(tasks) + 1)]
    for r0 in recs:
        if r0["method"] == "full" or r0["task"] != tasks[0]:
            continue
        cells, pooled = [], []
        for t in tasks:
            same = (x for x in recs if x["task"] == t and x["method"] == r0["method"] and x["budget"] == r0["budget"])
            r = next(same, None)
            if r is None or t not in full:
                cells.append("")
                continue
            d = [float(a["correct"]) - float(b["correct"]) for a, b in zip(r["item_scores"], full[t]["item_scores"])]
            pooled += d
            m, h = _mean_ci(d)
            cells.append(f"{m:+.3f} ±{h:.3f}")
        m, h = _mean_ci(pooled)
        lines.append(f"| {r0['method']} | {r0['budget']} | " + " | ".join(cells) + f" | {m:+.3f} ±{h:.3f} |")
    return "\n".join(lines)
