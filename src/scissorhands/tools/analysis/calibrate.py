"""Per-layer budgets from measured persistence: layers that persist less get more.

Rule: ``weight_l = (1 - p_l) + weight_floor`` where ``p_l`` is layer ``l``'s
persistence (form (b), mean over heads); budgets are proportional to the
weights, add up to ``budget * n_layers`` exactly, and every layer gets at
least ``recent + 1`` (largest-remainder rounding, the same rounding
:func:`scissorhands.core.settings.schedule.layer_budgets` applies when it rescales a JSON
schedule to another total).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

# The rounding the library uses to rescale a loaded schedule; sharing it keeps
# a calibrated schedule unchanged when it is loaded back at the same total.
from scissorhands.core.settings.schedule import round_to_total

METHOD = "weight = (1 - persistence) + weight_floor, normalised to budget * n_layers, floor recent + 1"


def calibrated_budgets(persistence: list[float], budget: int, recent: int = 10,
                       weight_floor: float = 0.1) -> list[int]:
    """Integer per-layer budgets, larger where persistence is lower.

    Parameters
    ----------
    persistence : list of float, length L
        Persistence ratio of each budgeted (full-attention) layer, in [0, 1].
    budget : int
        Average budget; the result sums to ``budget * L``.
    recent : int
        Recent window of the cache; each layer gets at least ``recent + 1``.
    weight_floor : float
        Added to every weight, so a fully persistent layer still gets a share.

    Returns
    -------
    list of int, length L
    """
    if not persistence:
        raise ValueError("persistence: no layer to calibrate")
    if any(not (0.0 <= p <= 1.0) or math.isnan(p) for p in persistence):
        raise ValueError(f"persistence: values must be in [0, 1], got {persistence}")
    if weight_floor < 0:
        raise ValueError(f"weight-floor: must be >= 0, got {weight_floor}")
    floor = recent + 1
    if budget < floor:
        raise ValueError(f"budget: must be > recent ({recent}), got {budget}")
    weights = [(1.0 - p) + weight_floor for p in persistence]
    if sum(weights) <= 0:
        weights = [1.0] * len(persistence)
    return round_to_total(weights, budget * len(persistence), floor)


def save_schedule(path: str | Path, budgets: list[int], source: str, **extra) -> Path:
    """Write ``{"budgets": [...], "method": ..., "source": ...}`` (plus ``extra``) as JSON."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"budgets": list(budgets), "method": METHOD, "source": source, **extra}, indent=1) + "\n")
    return p
