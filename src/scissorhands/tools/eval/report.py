"""What an eval grid's rows say: labels, the summary tables (paired with the full cache) and the plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from scissorhands.core.settings.config import CacheSettings

from ..stats import NO_INTERVAL, Z95, paired_difference, plus_minus
from .records import as_keyed_today, jsonable, key_id, load_results


def _fmt(rec: dict) -> str:
    m = rec["metrics"]
    if rec["task"] == "ppl":
        return f"{m['ppl']:.2f}{plus_minus((m['ppl_ci95'][1] - m['ppl_ci95'][0]) / 2, 2)}"
    if rec["task"] == "agreement":
        return f"{m['first_divergence']:.1f}{plus_minus(m['first_divergence_ci95'], 1)}"
    if "acc_norm" in m:
        return f"{m['acc']:.3f} / {m['acc_norm']:.3f}{plus_minus(m['acc_stderr'], 3)}"
    return f"{m['acc']:.3f}{plus_minus(m['acc_stderr'], 3)}"


def _row_settings(rec: dict) -> dict:
    """The settings a row was scored with, as a run today keys them (an exact full cache: none)."""
    key = rec.get("key")
    if isinstance(key, dict) and isinstance(key.get("settings"), dict):
        return as_keyed_today(key)["settings"]
    config = rec.get("config")
    return {**jsonable(CacheSettings().as_dict()), **config} if isinstance(config, dict) else {}


def _setting_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def row_labels(results: list[dict]) -> list[str]:
    """A name for each row: its method, and where one method's rows were scored with different settings
    (two runs into one folder, ``--prefill stream`` then ``prompt-aware``), the settings that tell them apart,
    so that no row hides another in a table or a plot."""
    settings = [_row_settings(r) for r in results]
    defaults = jsonable(CacheSettings().as_dict())
    differ: dict[str, list[str]] = {}
    for method in dict.fromkeys(r["method"] for r in results):
        mine = [s for r, s in zip(results, settings) if r["method"] == method]
        keyed = [s for s in mine if s]
        names = list(dict.fromkeys(k for s in keyed for k in s))
        seen = [{json.dumps(s.get(k), sort_keys=True) for s in keyed} for k in names]
        if len(keyed) < len(mine):  # beside an exact full cache (keyed by no settings): what sets the others apart
            seen = [v | {json.dumps(defaults.get(k), sort_keys=True)} for k, v in zip(names, seen)]
        differ[method] = [k for k, v in zip(names, seen) if len(v) > 1]
    labels = []
    for r, s in zip(results, settings):
        parts = [f"{k}={_setting_text(s.get(k))}" for k in differ[r["method"]]] if s else []
        labels.append(f"{r['method']} ({', '.join(parts)})" if parts else r["method"])
    return labels


def _in_order(results: list[dict]) -> list[dict]:
    """Rows for a table: the full cache first, then each method in the order it first appears, from the least
    compression to the most (rows appended by later runs land beside their method, not at the end)."""
    first = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in results))}
    return sorted(results, key=lambda r: (r["method"] != "full", first[r["method"]], r.get("compression") or 0.0))


def summary_table(results: list[dict]) -> str:
    """Markdown: one row per method (and settings, see :func:`row_labels`) and budget, one column per task."""
    results = _in_order(results)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    labels = row_labels(results)
    rows = list(dict.fromkeys((name, r["budget"]) for name, r in zip(labels, results)))
    by = {(name, r["budget"], r["task"]): r for name, r in zip(labels, results)}
    head = "| method | budget | " + " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 2)]
    for name, budget in rows:
        cells = []
        for t in tasks:
            r = by.get((name, budget, t))
            cells.append("" if r is None else f"{_fmt(r)} ({r['compression']:.1f}x)")
        lines.append(f"| {name} | {'full' if budget is None else budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def folder_results(path: Path, results: list[dict]) -> list[dict]:
    """The rows of ``results`` and every row of earlier runs in the results file at ``path`` that was measured
    the same way (version, model, task windows, limit, seed): what the folder's summary.md and plots show.

    Each cell appears once (the last row written for it); rows measured another way are left out, as are rows
    without a key (written before keys existed).
    """
    def ident(rec: dict):
        key = rec.get("key")
        if not isinstance(key, dict):
            return None
        return json.dumps({k: v for k, v in key.items() if k not in ("method", "budget", "settings", "files")},
                          sort_keys=True)

    wanted = {ident(r) for r in results} - {None}
    cells: dict[str, dict] = {}
    for rec in load_results(path):
        if ident(rec) in wanted:
            cells[key_id(as_keyed_today(rec["key"]))] = rec
    for rec in results:
        key = rec.get("key")
        cells[key_id(as_keyed_today(key)) if isinstance(key, dict) else str(id(rec))] = rec
    return list(cells.values())


def paired_vs_full(results: list[dict], task: str = "ppl") -> list[dict]:
    """Each evicting row's difference to the full cache, paired over the same items, with a 95% interval.

    For ``ppl`` the mean NLL per window (``delta_nll``); for tasks whose items
    are right or wrong (multiple choice, LAMBADA, passkey) the accuracy
    (``delta_acc``, in points of a share, e.g. -0.05 = five points lower).
    """
    fulls = [r for r in results if r["task"] == task and r["method"] == "full"]
    if not fulls:
        return []
    full = next((r for r in fulls if not _row_settings(r)), fulls[0])  # the exact full cache, where there is one
    key = "nll" if task == "ppl" else "correct"
    if not full["item_scores"] or key not in full["item_scores"][0]:
        return []
    base = [float(s[key]) for s in full["item_scores"]]
    out = []
    for r, label in zip(results, row_labels(results)):
        if r["task"] != task or r is full or len(r["item_scores"]) != len(base):
            continue
        mean, half = paired_difference([float(s[key]) for s in r["item_scores"]], base)
        name = "delta_nll" if task == "ppl" else "delta_acc"
        out.append({"task": task, "method": r["method"], "label": label, "budget": r["budget"],
                    "compression": r["compression"], name: mean, f"{name}_ci95": half})
    return out


def summary_markdown(results: list[dict]) -> str:
    """summary.md: first the paired differences to the full cache (the numbers that matter), then every result."""
    lines = []
    results = _in_order(results)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    paired = {t: {(p["label"], p["budget"]): p for p in paired_vs_full(results, t)} for t in tasks}
    shown = [t for t in tasks if paired[t]]
    if shown:
        lines += ["## Against the full cache", "",
                  "Paired over the same items, mean difference and 95% interval: ΔNLL in nats per token (lower is "
                  "better; perplexity ratio = exp ΔNLL), Δacc in points of accuracy (higher is better).", "",
                  "| method | budget | " + " | ".join(f"{t} {'ΔNLL' if t == 'ppl' else 'Δacc'}" for t in shown) + " |",
                  "|" + "---|" * (len(shown) + 2)]
        for label, budget in dict.fromkeys(k for t in shown for k in paired[t]):
            cells = []
            for t in shown:
                p = paired[t].get((label, budget))
                name = "delta_nll" if t == "ppl" else "delta_acc"
                if p is None:
                    cells.append("")
                elif t == "ppl":
                    cells.append(f"{p[name]:+.4f}{plus_minus(p[name + '_ci95'], 4)} ({p['compression']:.1f}x)")
                else:
                    pts = plus_minus(100 * p[name + "_ci95"], 1)
                    cells.append(f"{100 * p[name]:+.1f}{pts} pts ({p['compression']:.1f}x)")
            lines.append(f"| {label} | {budget} | " + " | ".join(cells) + " |")
        lines += ["", "## Every result", ""]
    lines.append(summary_table(results))
    if any(NO_INTERVAL in line for line in lines):
        lines += ["", f"{NO_INTERVAL}: one item, so no interval."]
    return "\n".join(lines)


def _interval(rec: dict) -> tuple[float, float] | None:
    """The 95% interval of a row's main metric, when its task reports one."""
    m, v = rec["metrics"], rec["value"]
    if rec["task"] == "ppl" and isinstance(m.get("ppl_ci95"), list):
        lo, hi = m["ppl_ci95"]
        return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None
    for name in (f"{rec['metric']}_ci95",):
        if isinstance(m.get(name), (int, float)) and math.isfinite(m[name]):
            return v - m[name], v + m[name]
    se = m.get(f"{rec['metric']}_stderr")
    if isinstance(se, (int, float)) and math.isfinite(se):
        return v - Z95 * se, v + Z95 * se
    return None


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per task: the main metric against compression, one line per method (and settings), with 95% intervals."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in dict.fromkeys(r["task"] for r in results):
        recs = [r for r in results if r["task"] == task]
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = row_labels(recs)
        for method in dict.fromkeys(labels):
            mine = sorted((r for r, name in zip(recs, labels) if name == method), key=lambda r: r["compression"])
            spans = [_interval(r) for r in mine]
            if method == "full":
                line = ax.axhline(mine[0]["value"], color="black", linestyle="--", label="full (95% band)")
                if spans[0] is not None:
                    ax.axhspan(*spans[0], color=line.get_color(), alpha=0.08)
                continue
            xs, ys = [r["compression"] for r in mine], [r["value"] for r in mine]
            low = [y - (s[0] if s else y) for y, s in zip(ys, spans)]
            high = [(s[1] if s else y) - y for y, s in zip(ys, spans)]
            err = [low, high]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
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
