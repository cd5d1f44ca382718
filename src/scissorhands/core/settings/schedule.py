"""Per-layer budgets: how the total ``budget * n_layers`` is split across layers, and the settings that say how.

:class:`ScheduleSettings` is one group of :class:`~.config.CacheSettings`, and :class:`IncreasingSettings` the
setting the ``"increasing"`` schedule owns; :func:`layer_budgets` reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from . import declare as s
from .declare import setting

SCHEDULES = ("uniform", "increasing")


def _schedule(name, value):
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, tuple):
        for b in value:
            s.integer(1)(name, b)
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a name, a list of budgets or a JSON path, got {value!r}")
    if value not in SCHEDULES and not value.endswith(".json"):
        raise ValueError(f"{name}: must be one of {SCHEDULES}, a list of budgets or a .json file, got {value!r}")
    return value


@dataclass(frozen=True)
class ScheduleSettings:
    """How the total budget is split across layers: evenly, rising with depth, or a list of budgets."""

    schedule: str | tuple[int, ...] = setting(
        "uniform", '`"uniform"`, `"increasing"` (later layers more, same total), a list of budgets, or a JSON file',
        s.parse_schedule, _schedule, metavar="uniform|increasing|b1,b2,...|FILE.json")


@dataclass(frozen=True)
class IncreasingSettings:
    """The settings the ``"increasing"`` schedule owns: valid only with it (:func:`~.declare.own`)."""

    increasing_slope: float = setting(
        0.5, '`"increasing"` schedule: the last layer gets 1 + slope times the average, the first 1 - slope',
        s.parse_float, s.real(0.0, 1.0))


s.own("schedule", "increasing", IncreasingSettings)


def round_to_total(weights: list[float], total: int, floor: int) -> list[int]:
    """Integer budgets proportional to ``weights`` that add up to ``total`` exactly.

    Largest-remainder rounding, with every layer at least ``floor``.
    """
    weight = sum(weights)
    raw = [max(floor, total * w / weight) for w in weights]
    # Re-normalise after flooring so the free part still sums to the total.
    excess = sum(raw) - total
    if excess > 0:
        free = [r - floor for r in raw]
        free_total = sum(free)
        raw = [floor + f * (1 - excess / free_total) if free_total > 0 else floor for f in free]
    out = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def load_schedule(path: str | Path) -> list[int]:
    """Read per-layer budgets from a JSON file: ``{"budgets": [...]}`` or a plain list.

    Raises
    ------
    ValueError
        ``"schedule: ..."`` when the file is missing, unreadable, not UTF-8 JSON,
        or does not hold a non-empty list of positive integers (``true`` is not one).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"schedule: no such file {str(p)!r}")
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"schedule: {str(p)!r} is not a JSON schedule (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"schedule: {str(p)!r} is not valid JSON ({e.msg}, line {e.lineno})") from None
    except OSError as e:
        raise ValueError(f"schedule: cannot read {str(p)!r} ({e.strerror or e})") from None
    budgets = data.get("budgets") if isinstance(data, dict) else data
    if (not isinstance(budgets, list) or not budgets
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in budgets)):
        raise ValueError(f"schedule: {str(p)!r} must hold a list of positive integer budgets")
    return budgets


class Scheduled(Protocol):
    """What :func:`layer_budgets` reads of a :class:`~.config.ScissorhandsConfig`."""

    @property
    def budget(self) -> int: ...

    @property
    def schedule(self) -> str | tuple[int, ...]: ...

    @property
    def increasing_slope(self) -> float: ...

    @property
    def protected(self) -> int: ...


def layer_budgets(config: Scheduled, n_layers: int) -> list[int]:
    """Budgets for the ``n_layers`` budgeted (full-attention) layers.

    ``uniform`` and ``increasing`` keep the total at ``config.budget * n_layers``.
    An explicit list or a JSON file is used as given, after checking its length.
    A JSON schedule made at another total is rescaled to this total, so the
    calibrated *shape* carries over between budgets.
    """
    if n_layers < 1:
        raise ValueError("model: no full-attention layer to put a budget on")
    floor = config.protected + 1
    total = config.budget * n_layers
    sched = config.schedule
    if isinstance(sched, tuple):
        budgets = list(sched)
        if len(budgets) != n_layers:
            raise ValueError(f"schedule: {len(budgets)} budgets given for {n_layers} full-attention layers")
        return budgets
    if sched == "uniform":
        return [config.budget] * n_layers
    if sched == "increasing":
        if n_layers == 1:
            return [config.budget]
        a = config.increasing_slope
        weights = [1 - a + 2 * a * i / (n_layers - 1) for i in range(n_layers)]
        return round_to_total(weights, total, floor)
    budgets = load_schedule(sched)
    if len(budgets) != n_layers:
        raise ValueError(f"schedule: {sched!r} has {len(budgets)} budgets for {n_layers} full-attention layers")
    return round_to_total([float(b) for b in budgets], total, floor)
