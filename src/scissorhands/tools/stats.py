"""The few statistics the evaluation and the analysis report: means with intervals, paired differences."""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.96  # two-sided 95% normal quantile
NO_INTERVAL = "±—"  # what tables print for the interval of a single item (a NaN half-width)


def plus_minus(half: float, digits: int) -> str:
    """``" ±x"`` to ``digits`` places, or ``" "`` + :data:`NO_INTERVAL` when one item leaves no interval."""
    return f" {NO_INTERVAL}" if math.isnan(half) else f" ±{half:.{digits}f}"


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of a normal-approximation 95% interval (NaN half-width for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("values: is empty")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, Z95 * math.sqrt(var / n)


def proportion(hits: Sequence[bool]) -> tuple[float, float]:
    """Share of hits and its standard error."""
    n = len(hits)
    if n == 0:
        raise ValueError("hits: is empty")
    p = sum(hits) / n
    return p, math.sqrt(p * (1 - p) / n) if n > 1 else float("nan")


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of ``a[i] - b[i]`` and its 95% half-width: the two were measured on the same items."""
    if len(a) != len(b):
        raise ValueError(f"paired values: {len(a)} against {len(b)} items")
    return mean_ci([x - y for x, y in zip(a, b)])


def mcnemar_p(lost: int, gained: int) -> float:
    """McNemar's exact two-sided p-value for paired pass/fail results: ``lost`` items passed only by the first
    setup, ``gained`` only by the second. Under no difference each discordant item goes either way with
    probability 1/2, so the p-value is a binomial tail, doubled."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)
