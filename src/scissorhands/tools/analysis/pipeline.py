"""One analysis run: persistence, power law, calibration, bound and schedule perplexity."""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from scissorhands.core.planning.assembly import budget_tokens
from scissorhands.core.settings.config import DEFAULTS

from ..text import corpus_tokens, windows
from .bound import deviation_vs_budget
from .calibrate import METHOD, calibrated_budgets, save_schedule
from .capture import attention_maps, eager_copy, full_attention_layers, layer_windows, random_copy
from .compare import compare_schedules
from .persistence import key, layer_persistence
from .powerlaw import layer_power_law
from .settings import AnalysisSettings

SCHEDULE_FILE = "calibrated_schedule.json"


def summarise(per_window: list[torch.Tensor]) -> dict:
    """Per-layer mean and min over heads of a measure collected over windows.

    Parameters
    ----------
    per_window : list of Tensor, each shape (L, H)
        One entry per window; NaN marks an undefined value (form (a) with an
        empty late set).

    Returns
    -------
    dict
        ``mean``/``min``: per layer, over heads of the window-averaged value;
        ``std_windows``: per layer, spread over windows of the head mean;
        ``defined``: per layer, share of (window, head) values not NaN;
        ``overall``: mean of ``mean`` over layers.
    """
    stack = torch.stack(per_window)  # (W, L, H)
    head = stack.nanmean(0)  # (L, H)
    layer_mean = head.nanmean(-1)  # (L,)
    layer_min = torch.where(head.isnan(), torch.full_like(head, math.inf), head).min(-1).values  # (L,)
    layer_min = torch.where(layer_min.isinf(), torch.full_like(layer_min, math.nan), layer_min)
    window_means = stack.nanmean(-1)  # (W, L)
    std = window_means.std(0) if stack.shape[0] > 1 else torch.zeros_like(layer_mean)

    def clean(t):
        return [None if math.isnan(v) else round(v, 5) for v in t.tolist()]

    overall = layer_mean[~layer_mean.isnan()].mean().item() if (~layer_mean.isnan()).any() else math.nan
    return {"mean": clean(layer_mean), "min": clean(layer_min), "std_windows": clean(std),
            "defined": [round(v, 4) for v in (~stack.isnan()).float().mean((0, 2)).tolist()],
            "overall": None if math.isnan(overall) else round(overall, 5)}


def _log_ranks(length: int, points: int = 48) -> list[int]:
    return sorted({int(r) for r in np.geomspace(1, length, points).round()})


def measure_model(model, batches: list[list[int]], settings: AnalysisSettings, windows_per_layer,
                  progress=None) -> dict:
    """Persistence at every length and power-law fits at the longest, over the windows.

    Parameters
    ----------
    model : PreTrainedModel
        Runs eager attention.
    batches : list of list of int
        Windows of ``settings.length`` tokens.
    windows_per_layer : list of (int or None)
        Sliding window per layer.

    Returns
    -------
    dict
        ``persistence``: {str(T): {measure: :func:`summarise` output}};
        ``powerlaw``: per-layer ``alpha``, ``r2`` (means over heads and
        windows), ``alpha_std`` and the head-averaged curve at log-spaced ranks.
    """
    collected: dict[int, dict[str, list[torch.Tensor]]] = {t: {} for t in settings.seq_lens}
    alphas, r2s, curves = [], [], []
    length = settings.length
    for ids in batches:
        maps = attention_maps(model, torch.tensor(ids))  # L x (H, T, T)
        for t in settings.seq_lens:
            per_layer = [layer_persistence(a[:, :t, :t], list(settings.thresholds), list(settings.topk), w)
                         for a, w in zip(maps, windows_per_layer)]
            for name in per_layer[0]:
                collected[t].setdefault(name, []).append(torch.stack([p[name] for p in per_layer]))  # (L, H)
        if "powerlaw" in settings.parts:
            fits = [layer_power_law(a, settings.rank_lo, length // 2) for a in maps]
            alphas.append([f["alpha"] for f in fits])  # (L, H)
            r2s.append([f["r2"] for f in fits])
            curves.append([f["curve"] for f in fits])  # (L, T)
        del maps
        if progress is not None:
            progress.update(1)
    out: dict = {"persistence": {str(t): {name: summarise(v) for name, v in collected[t].items()}
                           for t in settings.seq_lens}}
    if alphas:
        a, r, c = np.array(alphas), np.array(r2s), np.array(curves).mean(0)  # (W, L, H), (W, L, H), (L, T)
        ranks = _log_ranks(length)
        out["powerlaw"] = {"rank_range": [settings.rank_lo, length // 2], "alpha": a.mean((0, 2)).round(4).tolist(),
                           "alpha_std": a.std((0, 2)).round(4).tolist(), "r2": r.mean((0, 2)).round(4).tolist(),
                           "r2_min": r.min((0, 2)).round(4).tolist(), "ranks": ranks,
                           "curve": c[:, np.array(ranks) - 1].tolist()}
    return out


def with_bos(batches: list[list[int]], tokenizer) -> list[list[int]]:
    """Each window as BOS followed by its first ``T - 1`` tokens (same length T)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError("bos: the tokenizer has no BOS token")
    return [[bos] + ids[:-1] for ids in batches]


def analyze(model, tokenizer, texts: list[tuple[str, str]], settings: AnalysisSettings, out_dir: str | Path,
            model_name: str = "", progress: bool = True, checkpoint=None) -> dict:
    """Run the requested parts of the analysis on one model.

    The corpus tokens are split once: the first ``calib_fraction`` feeds
    persistence, power law and calibration; the rest feeds the bound and the
    schedule comparison.

    Parameters
    ----------
    model : PreTrainedModel
        The trained model (its attention is switched to scissorhands by the
        compressed runs; plain forwards still compute SDPA).
    tokenizer : tokenizer
    texts : list of (name, text)
    settings : AnalysisSettings
    out_dir : path
        Where the calibrated schedule JSON is written.
    checkpoint : callable, optional
        Called with the partial result after each part, so a long run that
        fails late keeps what it measured.

    Returns
    -------
    dict
        Everything measured, JSON-serialisable.
    """
    out_dir = Path(out_dir)
    ids = corpus_tokens(tokenizer, texts)
    split = int(len(ids) * settings.calib_fraction)
    calib_ids, eval_ids = ids[:split], ids[split:]
    length = settings.length
    parts = settings.parts
    calib_windows = windows(calib_ids, length, settings.windows) if "persistence" in parts else []
    bound_windows = windows(eval_ids, length, settings.bound_windows, "bound-samples") if "bound" in parts else []
    ppl_windows = windows(eval_ids, settings.ppl_seq_len, settings.ppl_windows, "ppl-samples") if "ppl" in parts else []
    if settings.bos:
        calib_windows, bound_windows, ppl_windows = (with_bos(w, tokenizer) for w in
                                                     (calib_windows, bound_windows, ppl_windows))
    n_sched = 3 if "calibrate" in parts else 2
    total = (2 * len(calib_windows) + len(bound_windows) * (1 + len(settings.ratios))
             + len(ppl_windows) * (1 + len(settings.compressions) * n_sched))
    result: dict = {"model": model_name, "settings": asdict(settings),
                    "corpus_tokens": len(ids), "calibration_tokens": split, "n_layers": len(layer_windows(model)),
                    "layer_windows": layer_windows(model), "full_attention_layers": full_attention_layers(model),
                    "seconds": {}}
    bar = tqdm(total=total, disable=not progress, desc="analyze", unit="run")

    def done():
        if checkpoint is not None:
            checkpoint(result)

    try:
        if "persistence" in parts:
            start = time.perf_counter()
            result["measured"] = {}
            for label, make in (("trained", eager_copy), ("random", lambda m: random_copy(m, settings.seed))):
                bar.set_description(f"attention maps ({label})")
                twin = make(model)
                result["measured"][label] = measure_model(twin, calib_windows, settings, layer_windows(model), bar)
                del twin
            result["seconds"]["persistence"] = round(time.perf_counter() - start, 1)
            done()
        if "calibrate" in parts:
            result["calibration"] = calibrate(result, settings, out_dir)
        if "bound" in parts:
            start = time.perf_counter()
            bar.set_description("bound")
            per_window = []
            for w in bound_windows:
                per_window.append(deviation_vs_budget(model, torch.tensor(w), list(settings.ratios)))
                bar.update(1 + len(settings.ratios))
            result["bound"] = _average_bound(per_window)
            result["seconds"]["bound"] = round(time.perf_counter() - start, 1)
            done()
        if "ppl" in parts:
            start = time.perf_counter()
            bar.set_description("schedules")
            schedules = {"uniform": "uniform", "increasing": "increasing"}
            if "calibration" in result:
                schedules["calibrated"] = result["calibration"]["path"]
            result["ppl"] = compare_schedules(model, ppl_windows, list(settings.compressions), schedules, bar)
            result["seconds"]["ppl"] = round(time.perf_counter() - start, 1)
    finally:
        bar.close()
    return result


def calibrate(result: dict, settings: AnalysisSettings, out_dir: Path) -> dict:
    """Calibrated schedule from the trained model's form (b) persistence at the longest length."""
    measure = key("b", settings.calib_topk)
    per_layer = result["measured"]["trained"]["persistence"][str(settings.length)][measure]["mean"]
    full = result["full_attention_layers"]
    persistence = [per_layer[i] for i in full]
    recent = DEFAULTS.protected  # every layer budget must exceed it
    budget = budget_tokens(settings.budget, settings.ppl_seq_len, DEFAULTS)
    budgets = calibrated_budgets(persistence, budget, recent, settings.weight_floor)
    source = (f"{result['model']}: form (b) top-{settings.calib_topk * 100:g}% persistence, mean over heads, "
              f"T={settings.length}, {settings.windows} calibration windows from the first "
              f"{settings.calib_fraction:g} of the corpus tokens")
    path = save_schedule(out_dir / SCHEDULE_FILE, budgets, source, layers=full, persistence=persistence,
                         average_budget=budget, weight_floor=settings.weight_floor)
    return {"path": str(path), "budgets": budgets, "layers": full, "persistence": persistence,
            "average_budget": budget, "method": METHOD}


def _average_bound(per_window: list[list[dict]]) -> list[dict]:
    """Average the per-ratio deviation records of several windows."""
    out = []
    for records in zip(*per_window):
        first = records[0]
        row = {"ratio": first["ratio"], "budget": first["budget"], "windows": len(records)}
        for name in ("layer_rel_l2", "layer_rel_l2_evicted"):
            row[name] = np.mean([r[name] for r in records], axis=0).round(6).tolist()
        for name in ("kl", "kl_evicted"):
            row[name] = round(float(np.mean([r[name] for r in records])), 6)
        row["mean_rel_l2"] = round(float(np.mean(row["layer_rel_l2"])), 6)
        row["mean_rel_l2_evicted"] = round(float(np.mean(row["layer_rel_l2_evicted"])), 6)
        out.append(row)
    return out
