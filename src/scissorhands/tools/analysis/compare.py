"""Perplexity of per-layer budget schedules through the project's exact scorer."""

from __future__ import annotations

import math

import torch

from scissorhands.core.methods import get_method
from scissorhands.core.planning.assembly import budget_tokens
from scissorhands.core.settings.config import DEFAULTS, CacheSettings
from scissorhands.hf.scoring import ScoreSetup, token_logprobs

from ..stats import paired_difference


def window_nll(model, ids: list[int], budget: int | None, schedule="uniform") -> float:
    """Mean negative log-likelihood of one window, streamed through the cache (``budget=None``: full)."""
    method = get_method("full" if budget is None else "scissorhands")
    base = CacheSettings(schedule=schedule)
    logprobs, _ = token_logprobs(model, torch.tensor(ids), ScoreSetup(method, budget, base))
    return float(-logprobs.mean())


def compare_schedules(model, windows: list[list[int]], compressions: list[float], schedules: dict,
                      progress=None) -> dict:
    """Perplexity of each schedule at each compression, paired over the same windows.

    Parameters
    ----------
    model : PreTrainedModel
    windows : list of list of int
        Token windows, all of length T.
    compressions : list of float
        Compression factors ``c``: the average budget is ``T / c``.
    schedules : dict of str to schedule
        Name to anything :class:`ScissorhandsConfig` accepts as ``schedule``
        (``"uniform"``, ``"increasing"``, a JSON path). ``"uniform"`` must be
        among them: the others are paired against it.
    progress : tqdm, optional
        Advanced by one per scored window and setting.

    Returns
    -------
    dict
        ``full``: {``nll``: per-window list, ``ppl``}; ``runs``: one dict per
        (compression, schedule) with ``budget``, per-window ``nll``, ``ppl``,
        and ``delta_nll`` / ``delta_nll_ci95``: the mean paired NLL difference
        to the uniform schedule and its normal 95% interval.
    """
    if "uniform" not in schedules:
        raise ValueError("schedules: must include 'uniform' to pair against")
    length = len(windows[0])

    def tick():
        if progress is not None:
            progress.update(1)

    full = []
    for ids in windows:
        full.append(window_nll(model, ids, None))
        tick()
    runs = []
    for c in compressions:
        budget = budget_tokens(1.0 / c, length, DEFAULTS)
        per_schedule = {}
        for name, schedule in schedules.items():
            nll = []
            for ids in windows:
                nll.append(window_nll(model, ids, budget, schedule))
                tick()
            per_schedule[name] = nll
        for name, nll in per_schedule.items():
            mean, half = paired_difference(nll, per_schedule["uniform"])
            runs.append({"compression": c, "budget": budget, "schedule": name, "nll": nll,
                         "ppl": math.exp(sum(nll) / len(nll)), "delta_nll": mean,
                         "delta_nll_ci95": half if len(nll) > 1 else 0.0})
    return {"full": {"nll": full, "ppl": math.exp(sum(full) / len(full))}, "runs": runs, "seq_len": length,
            "windows": len(windows)}
