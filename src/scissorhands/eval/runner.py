"""Run a grid of (task, method, budget), write one JSON line per result, summarise and plot."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..budget import resolve_budget
from ..config import CacheSettings
from ..methods import EvictionMethod
from ..modelinfo import model_facts
from ..scoring import ScoreSetup
from ..stats import paired_difference
from .tasks import Task

logger = logging.getLogger(__name__)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V per token, summed over the budgeted (full-attention) layers."""
    return model_facts(model).kv_bytes_per_token(next(model.parameters()).element_size())


def _key(rec: dict) -> tuple:
    return rec["task"], rec["method"], rec["budget"]


def load_results(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_grid(model, tokenizer, *, model_name: str, tasks: list[Task], methods: list[type[EvictionMethod]],
             budgets: list[float], base: CacheSettings, out_dir: Path, limit: int | None = None, seed: int = 0,
             resume: bool = True) -> list[dict]:
    """Evaluate every method at every budget on every task.

    Results already in ``out_dir/results.jsonl`` (same task, method, budget) are
    reused when ``resume`` is set, so an interrupted grid continues where it stopped.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.jsonl"
    done = {_key(r): r for r in load_results(path)} if resume else {}
    per_token = kv_bytes_per_token(model)
    results = []
    for task in tasks:
        items = task.items(tokenizer, limit)
        if not items:
            raise ValueError(f"tasks: {task.name} has no items")
        for method in methods:
            for spec in ([None] if method.is_full else budgets):
                key = (task.name, method.name, spec)
                if key in done:
                    results.append(done[key])
                    continue
                start = time.perf_counter()
                scores, budgets_used = [], []
                desc = f"{task.name} {method.name} {'full' if spec is None else spec}"
                for item in tqdm(items, desc=desc, leave=False):
                    budget = None if spec is None else resolve_budget(spec, item.length, base.protected)
                    budgets_used.append(item.length if budget is None else min(budget, item.length))
                    scores.append(task.score(model, item, ScoreSetup(method, budget, base, seed)))
                metrics = task.aggregate(scores)
                mean_len = sum(i.length for i in items) / len(items)
                mean_budget = sum(budgets_used) / len(budgets_used)
                rec = {
                    "task": task.name, "method": method.name, "budget": spec, "model": model_name,
                    "metric": task.main_metric, "value": metrics[task.main_metric], "metrics": metrics,
                    "compression": mean_len / mean_budget, "mean_length": mean_len, "mean_budget": mean_budget,
                    "kv_bytes": mean_budget * per_token, "full_kv_bytes": mean_len * per_token,
                    "wall_s": time.perf_counter() - start, "n_items": len(items), "seed": seed,
                    "config": method.resolve(base).as_dict(),
                    "item_scores": scores,
                }
                with path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                logger.info("%s: %s=%.4f (%.1f s)", desc, task.main_metric, rec["value"], rec["wall_s"])
                results.append(rec)
    return results


def _fmt(rec: dict) -> str:
    m = rec["metrics"]
    if rec["task"] == "ppl":
        return f"{m['ppl']:.2f} ±{(m['ppl_ci95'][1] - m['ppl_ci95'][0]) / 2:.2f}"
    if rec["task"] == "agreement":
        return f"{m['first_divergence']:.1f} ±{m['first_divergence_ci95']:.1f}"
    if "acc_norm" in m:
        return f"{m['acc']:.3f} / {m['acc_norm']:.3f} ±{m['acc_stderr']:.3f}"
    return f"{m['acc']:.3f} ±{m['acc_stderr']:.3f}"


def summary_table(results: list[dict]) -> str:
    """Markdown: one row per (method, budget), one column per task."""
    tasks = list(dict.fromkeys(r["task"] for r in results))
    rows = list(dict.fromkeys((r["method"], r["budget"]) for r in results))
    by = {(r["method"], r["budget"], r["task"]): r for r in results}
    head = "| method | budget | " + " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 2)]
    for method, budget in rows:
        cells = []
        for t in tasks:
            r = by.get((method, budget, t))
            cells.append("" if r is None else f"{_fmt(r)} ({r['compression']:.1f}x)")
        lines.append(f"| {method} | {'full' if budget is None else budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_vs_full(results: list[dict], task: str = "ppl") -> list[dict]:
    """Per-window mean NLL difference to the full cache, with a 95% interval (paired over windows)."""
    full = next((r for r in results if r["task"] == task and r["method"] == "full"), None)
    if full is None:
        return []
    base = [s["nll"] for s in full["item_scores"]]
    out = []
    for r in results:
        if r["task"] != task or r["method"] == "full":
            continue
        mean, half = paired_difference([s["nll"] for s in r["item_scores"]], base)
        out.append({"method": r["method"], "budget": r["budget"], "compression": r["compression"],
                    "delta_nll": mean, "delta_nll_ci95": half})
    return out


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per task: the main metric against compression, one line per method."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in dict.fromkeys(r["task"] for r in results):
        recs = [r for r in results if r["task"] == task]
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in dict.fromkeys(r["method"] for r in recs):
            pts = sorted((r["compression"], r["value"]) for r in recs if r["method"] == method)
            if method == "full":
                ax.axhline(pts[0][1], color="black", linestyle="--", label="full")
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("KV compression (sequence length / budget)")
        ax.set_ylabel(recs[0]["metric"])
        ax.set_xscale("log")
        ticks = sorted({round(r["compression"], 1) for r in recs})
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(f"{task} — {recs[0]['model']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{task}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
