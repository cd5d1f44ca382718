"""Markdown tables and plots for docs/results.md from the eval grid's JSONL.

    python experiments/results_tables.py docs/results/ppl docs/results/fewshot > docs/results_tables.md
"""

import argparse
from pathlib import Path

from scissorhands.tools.eval.records import load_results
from scissorhands.tools.eval.report import paired_vs_full, plot_results


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
    p = argparse.ArgumentParser(description="Print the docs' perplexity and few-shot tables (and write the plots) "
                                            "from eval grid output folders.")
    p.add_argument("dirs", nargs="+", help="folders holding a results.jsonl (the plots are written beside it)")
    args = p.parse_args()
    out = []
    for d in args.dirs:
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
