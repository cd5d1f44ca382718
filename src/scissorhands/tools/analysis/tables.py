"""Markdown tables of an analysis result (the numbers quoted in docs/analysis.md)."""

from __future__ import annotations

import numpy as np

from .bound import fit_through_origin
from .persistence import key


def _f(v, digits: int = 3) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.{digits}f}"


def persistence_overview(result: dict) -> str:
    """Mean over layers of the head-mean persistence, trained vs random, for every measure and length."""
    measured = result["measured"]
    s = result["settings"]
    lines = ["| T | measure | trained | random | chance (trained / random) | random heads defined |",
             "|---|---|---|---|---|---|"]
    for length in measured["trained"]["persistence"]:
        tr, rd = measured["trained"]["persistence"][length], measured["random"]["persistence"][length]
        for m in s["thresholds"]:
            name, cov = key("a", m), key("a_coverage", m)
            defined = np.mean(rd[name]["defined"])
            lines.append(f"| {length} | (a) {m:g}/t | {_f(tr[name]['overall'])} | {_f(rd[name]['overall'])} | "
                         f"{_f(tr[cov]['overall'])} / {_f(rd[cov]['overall'])} | {defined:.0%} |")
        for form, label in (("b", "(b)"), ("bnorm", "(b')")):
            for k in s["topk"]:
                name = key(form, k)
                lines.append(f"| {length} | {label} top {k * 100:g}% | {_f(tr[name]['overall'])} | "
                             f"{_f(rd[name]['overall'])} | {k:g} | |")
    return "\n".join(lines)


def layer_table(result: dict, length: int | None = None) -> str:
    """Per-layer persistence (at ``length``, default the longest) and power law (longest), trained vs random."""
    s = result["settings"]
    at = str(length or max(s["seq_lens"]))
    k = s["calib_topk"]
    tr = result["measured"]["trained"]
    rd = result["measured"]["random"]
    pt, pr = tr["persistence"][at], rd["persistence"][at]
    a1, cov1, a5 = key("a", s["thresholds"][0]), key("a_coverage", s["thresholds"][0]), None
    if len(s["thresholds"]) > 2:
        a5 = key("a", s["thresholds"][2])
    b, bn = key("b", k), key("bnorm", k)
    head = (f"| layer | attn | (a) {s['thresholds'][0]:g}/t tr / rd | chance tr |"
            + (f" (a) {s['thresholds'][2]:g}/t tr / rd |" if a5 else "")
            + f" (b) {k * 100:g}% tr / rd | (b) min head tr | (b') {k * 100:g}% tr / rd |"
            + (" α tr / rd | R² tr / rd |" if "powerlaw" in tr else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    full = set(result["full_attention_layers"])
    for i in range(result["n_layers"]):
        row = (f"| {i} | {'full' if i in full else 'sliding'} | {_f(pt[a1]['mean'][i])} / {_f(pr[a1]['mean'][i])} | "
               f"{_f(pt[cov1]['mean'][i])} |")
        if a5:
            row += f" {_f(pt[a5]['mean'][i])} / {_f(pr[a5]['mean'][i])} |"
        row += (f" {_f(pt[b]['mean'][i])} / {_f(pr[b]['mean'][i])} | {_f(pt[b]['min'][i])} | "
                f"{_f(pt[bn]['mean'][i])} / {_f(pr[bn]['mean'][i])} |")
        if "powerlaw" in tr:
            row += (f" {_f(tr['powerlaw']['alpha'][i], 2)} / {_f(rd['powerlaw']['alpha'][i], 2)} |"
                    f" {_f(tr['powerlaw']['r2'][i])} / {_f(rd['powerlaw']['r2'][i])} |")
        lines.append(row)
    return "\n".join(lines)


def bound_table(result: dict) -> str:
    """Deviation from the full cache at each B/T, with the through-origin fit against 1 - B/T."""
    rows = result["bound"]
    lines = ["| B/T | budget | mean rel. L2 (all t) | mean rel. L2 (t ≥ B) | max-layer rel. L2 | KL (all t) "
             "| KL (t ≥ B) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ratio']:g} | {r['budget']} | {r['mean_rel_l2']:.4f} | {r['mean_rel_l2_evicted']:.4f} | "
                     f"{max(r['layer_rel_l2']):.4f} | {r['kl']:.4f} | {r['kl_evicted']:.4f} |")
    gap = [1 - r["ratio"] for r in rows]
    fits = []
    for name in ("mean_rel_l2", "mean_rel_l2_evicted", "kl", "kl_evicted"):
        slope, r2 = fit_through_origin(gap, [r[name] for r in rows])
        fits.append(f"{name} ≈ {slope:.4f}·(1 − B/T) (R² {r2:.3f})")
    return "\n".join(lines) + "\n\nFits through the origin: " + "; ".join(fits) + "."


def ppl_table(result: dict) -> str:
    """Perplexity per schedule and compression, with the paired NLL difference to uniform."""
    p = result["ppl"]
    lines = [f"Full cache: perplexity {p['full']['ppl']:.3f} ({p['windows']} windows of T={p['seq_len']}).", "",
             "| compression | avg budget | schedule | perplexity | ΔNLL vs uniform (95% CI) |",
             "|---|---|---|---|---|"]
    for r in p["runs"]:
        lines.append(f"| {r['compression']:g}x | {r['budget']} | {r['schedule']} | {r['ppl']:.3f} | "
                     f"{r['delta_nll']:+.4f} ± {r['delta_nll_ci95']:.4f} |")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """Every table the result has data for, with headings."""
    parts = []
    if "measured" in result:
        longest = max(result["settings"]["seq_lens"])
        parts += ["### Persistence overview", persistence_overview(result),
                  f"### Per layer, T={longest}", layer_table(result)]
        windows = [w for w in result.get("layer_windows", []) if w is not None]
        inside = [t for t in result["settings"]["seq_lens"] if windows and t <= min(windows)]
        if windows and min(windows) < longest and inside:
            # At T beyond the window, second-half queries of a sliding layer cannot see the early keys.
            parts += [f"### Per layer, T={max(inside)} (within the sliding window)", layer_table(result, max(inside))]
    if "calibration" in result:
        cal = result["calibration"]
        parts += ["### Calibrated schedule", f"Layers {cal['layers']}: budgets {cal['budgets']} at average "
                  f"{cal['average_budget']} (persistence {[round(p, 3) for p in cal['persistence']]})."]
    if "ppl" in result:
        parts += ["### Schedules on perplexity", ppl_table(result)]
    if "bound" in result:
        parts += ["### Deviation against the bound", bound_table(result)]
    return "\n\n".join(parts) + "\n"
