"""Plots (matplotlib, Agg) and a plain-text summary of an analysis result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..stats import plus_minus
from .bound import fit_through_origin
from .persistence import key


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def save_json(result: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return p


def model_label(result: dict) -> str:
    """Short model name for titles: a file path becomes its stem."""
    name = str(result.get("model", ""))
    return Path(name).stem if "/" in name or name.endswith(".gguf") else name


def _nan(values):
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def plot_persistence(result: dict, path: Path) -> Path:
    """Per-layer persistence, trained vs random side by side, for three measures at the longest length."""
    plt = _pyplot()
    s = result["settings"]
    length = str(max(s["seq_lens"]))
    k = s["calib_topk"]
    m = s["thresholds"][0]
    measures = [(key("a", m), f"(a) union, threshold {m:g}/t", key("a_coverage", m)),
                (key("b", k), f"(b) top-{k * 100:g}% overlap", None),
                (key("bnorm", k), f"(b') top-{k * 100:g}% overlap, position-normalised", None)]
    fig, axes = plt.subplots(len(measures), 1, figsize=(11, 3.2 * len(measures)), sharex=True)
    for ax, (name, title, chance_key) in zip(axes, measures):
        x = np.arange(result["n_layers"])
        for off, label, color in ((-0.2, "trained", "C0"), (0.2, "random", "C3")):
            summ = result["measured"][label]["persistence"][length][name]
            ax.bar(x + off, _nan(summ["mean"]), width=0.4, color=color, alpha=0.8, label=f"{label}: mean over heads")
            ax.plot(x + off, _nan(summ["min"]), "v", color="k" if label == "trained" else "0.5", ms=4,
                    label=f"{label}: min over heads")
            if chance_key is not None:
                chance = result["measured"][label]["persistence"][length][chance_key]["mean"]
                ax.plot(x + off, _nan(chance), "_", color=color, ms=10, mew=2, label=f"{label}: chance (|E|/(T/2))")
        if chance_key is None:
            ax.axhline(k, color="0.3", ls=":", lw=1, label=f"chance ({k:g})")
        for i in result["full_attention_layers"] if len(result["full_attention_layers"]) < result["n_layers"] else []:
            ax.axvspan(i - 0.5, i + 0.5, color="0.9", zorder=0)
        ax.set_ylim(0, 1.45)
        ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
        ax.set_xticks(x[:: max(1, len(x) // 30)])
        ax.set_xlim(-0.7, len(x) - 0.3)
        ax.set_ylabel("persistence")
        ax.set_title(f"{model_label(result)}: {title}, T={length}", fontsize=10)
        ax.legend(fontsize=7, ncol=4, loc="upper center")
    axes[-1].set_xlabel("layer" + (" (shaded: full attention)" if len(result["full_attention_layers"])
                                   < result["n_layers"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_powerlaw(result: dict, path: Path) -> Path:
    """Rank-frequency curves of three layers and the fitted exponent per layer, trained vs random."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    n = result["n_layers"]
    for label, ls in (("trained", "-"), ("random", "--")):
        pl = result["measured"][label]["powerlaw"]
        for i, layer in enumerate(sorted({0, n // 2, n - 1})):
            left.loglog(pl["ranks"], pl["curve"][layer], ls, color=f"C{i}", label=f"{label} layer {layer}")
    lo, hi = result["measured"]["trained"]["powerlaw"]["rank_range"]
    left.axvspan(lo, hi, color="0.93", zorder=0, label=f"fit ranks {lo}-{hi}")
    left.set_xlabel("rank")
    left.set_ylabel("accumulated attention (mean over heads)")
    left.legend(fontsize=7)
    x = np.arange(n)
    for label, color in (("trained", "C0"), ("random", "C3")):
        pl = result["measured"][label]["powerlaw"]
        right.errorbar(x, pl["alpha"], yerr=pl["alpha_std"], fmt="o-", color=color, ms=3, lw=1,
                       label=f"{label}: exponent")
    twin = right.twinx()
    for label, color in (("trained", "C0"), ("random", "C3")):
        twin.plot(x, result["measured"][label]["powerlaw"]["r2"], ":", color=color, label=f"{label}: R²")
    twin.set_ylim(0, 1.02)
    twin.set_ylabel("R² (dotted)")
    right.set_xlabel("layer")
    right.set_ylabel("fitted exponent α")
    right.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="lower right")
    length = max(result["settings"]["seq_lens"])
    fig.suptitle(f"{model_label(result)}: accumulated attention rank-frequency, T={length}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bound(result: dict, path: Path) -> Path:
    """Attention-output deviation and next-token KL against 1 - B/T."""
    plt = _pyplot()
    rows = result["bound"]
    gap = np.array([1 - r["ratio"] for r in rows])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    per_layer = np.array([r["layer_rel_l2"] for r in rows])  # (ratios, L)
    full = result["full_attention_layers"]
    for layer in sorted({full[0], full[len(full) // 2], full[-1]}):
        left.plot(gap, per_layer[:, layer], "o-", ms=3, lw=1, label=f"layer {layer}")
    left.plot(gap, per_layer.mean(1), "ks-", lw=2, label="mean over layers")
    slope, r2 = fit_through_origin(gap, per_layer.mean(1))
    line = np.linspace(0, gap.max(), 20)
    left.plot(line, slope * line, ":", color="0.4", label=f"{slope:.3f}·(1-B/T), R²={r2:.2f}")
    left.plot(gap, [r["mean_rel_l2_evicted"] for r in rows], "k^--", lw=1,
              label="mean over layers, positions t ≥ B only")
    left.set_xlabel("1 - B/T")
    left.set_ylabel("relative L2 of attention output")
    left.legend(fontsize=7)
    right.plot(gap, [r["kl"] for r in rows], "ko-", label="all positions")
    slope, r2 = fit_through_origin(gap, [r["kl"] for r in rows])
    right.plot(line, slope * line, ":", color="0.4", label=f"{slope:.3f}·(1-B/T), R²={r2:.2f}")
    right.plot(gap, [r["kl_evicted"] for r in rows], "k^--", label="positions t ≥ B")
    right.set_xlabel("1 - B/T")
    right.set_ylabel("KL(full || compressed), nats")
    right.legend(fontsize=7)
    fig.suptitle(f"{model_label(result)}: deviation from the full cache, T={max(result['settings']['seq_lens'])}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_schedule(result: dict, path: Path) -> Path:
    """Calibrated budgets per full-attention layer, with the persistence that set them."""
    plt = _pyplot()
    cal = result["calibration"]
    layers = cal["layers"]
    x = np.arange(len(layers))
    fig, ax = plt.subplots(figsize=(11, 3.8))
    ax.bar(x, cal["budgets"], color="C2", alpha=0.8, label="calibrated budget")
    ax.axhline(cal["average_budget"], color="k", ls=":", label="uniform")
    ax.set_xticks(x, [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("full-attention layer")
    ax.set_ylabel("tokens")
    twin = ax.twinx()
    twin.plot(x, cal["persistence"], "o-", color="C0", ms=3, label="form (b) persistence")
    twin.set_ylim(0, 1)
    twin.set_ylabel("persistence")
    ax.legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    ax.set_title(f"{model_label(result)}: calibrated schedule at average budget {cal['average_budget']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    """Every plot the result has data for; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    measured = result.get("measured", {})
    if measured:
        paths.append(plot_persistence(result, out / "persistence.png"))
    if measured and "powerlaw" in measured.get("trained", {}):
        paths.append(plot_powerlaw(result, out / "powerlaw.png"))
    if "bound" in result:
        paths.append(plot_bound(result, out / "bound.png"))
    if "calibration" in result:
        paths.append(plot_schedule(result, out / "schedule.png"))
    return paths


def _fmt(v) -> str:
    return "  n/a" if v is None else f"{v:5.3f}"


def summary(result: dict) -> str:
    """Plain-text summary: persistence by measure and length, power law, bound, schedules."""
    lines = [f"model {model_label(result)}: {result['n_layers']} layers, full attention at "
             f"{result['full_attention_layers']}"]
    measured = result.get("measured")
    if measured:
        lines.append("persistence, mean over layers of the head mean (trained / random; lowest layer mean):")
        for length, table in measured["trained"]["persistence"].items():
            for name in table:
                if "coverage" in name or "late" in name:
                    continue
                t, r = table[name], measured["random"]["persistence"][length][name]
                means = _nan(t["mean"])
                low = int(np.nanargmin(means)) if not np.isnan(means).all() else -1
                extra = ""
                if name.startswith("a@"):
                    cov = name.replace("a@", "a_coverage@")
                    extra = (f"  chance {_fmt(table[cov]['overall'])} / "
                             f"{_fmt(measured['random']['persistence'][length][cov]['overall'])}")
                lines.append(f"  T={length:>5} {name:<10} {_fmt(t['overall'])} / {_fmt(r['overall'])}"
                             f"  lowest layer {low} ({_fmt(means[low] if low >= 0 else None)}){extra}")
        if "powerlaw" in measured["trained"]:
            lo, hi = measured["trained"]["powerlaw"]["rank_range"]
            for label in ("trained", "random"):
                pl = measured[label]["powerlaw"]
                lines.append(f"power law ({label}, ranks {lo}-{hi}): exponent {np.mean(pl['alpha']):.3f} "
                             f"(layers {min(pl['alpha']):.2f}..{max(pl['alpha']):.2f}), R² {np.mean(pl['r2']):.3f} "
                             f"(lowest {min(pl['r2']):.3f})")
    if "calibration" in result:
        cal = result["calibration"]
        lines.append(f"calibrated budgets (average {cal['average_budget']}): {cal['budgets']} -> {cal['path']}")
    if "bound" in result:
        lines.append("bound: 1-B/T  mean rel L2 (all / t>=B)   KL (all / t>=B)")
        for r in result["bound"]:
            lines.append(f"       {1 - r['ratio']:.2f}  {r['mean_rel_l2']:.4f} / {r['mean_rel_l2_evicted']:.4f}"
                         f"   {r['kl']:.4f} / {r['kl_evicted']:.4f}")
        gap = [1 - r["ratio"] for r in result["bound"]]
        for name in ("mean_rel_l2", "kl"):
            slope, r2 = fit_through_origin(gap, [r[name] for r in result["bound"]])
            lines.append(f"       {name} ~ {slope:.4f} * (1 - B/T): R² {r2:.3f}")
    if "ppl" in result:
        p = result["ppl"]
        lines.append(f"perplexity, {p['windows']} windows of T={p['seq_len']}: full cache {p['full']['ppl']:.3f}")
        for r in p["runs"]:
            lines.append(f"  {r['compression']:g}x (budget {r['budget']}) {r['schedule']:<11} ppl {r['ppl']:.3f}"
                         f"  ΔNLL vs uniform {r['delta_nll']:+.4f}{plus_minus(r['delta_nll_ci95'], 4)}")
    if result.get("seconds"):
        lines.append("seconds: " + ", ".join(f"{k} {v}" for k, v in result["seconds"].items()))
    return "\n".join(lines)
