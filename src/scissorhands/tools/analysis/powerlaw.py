"""Rank-frequency of accumulated attention, and a log-log power-law fit."""

from __future__ import annotations

import numpy as np
import torch


def rank_frequency(attn: torch.Tensor) -> torch.Tensor:
    """Attention each key accumulates over all queries, sorted high to low, per head.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)

    Returns
    -------
    Tensor, shape (H, T)
        Row ``h`` is the ``T`` column sums of head ``h`` in descending order
        (rank 1 first). Each row sums to ``T`` (every query row sums to 1).
    """
    return attn.float().sum(dim=1).sort(dim=-1, descending=True).values  # (H, T)


def fit_power_law(values, rank_lo: int = 2, rank_hi: int | None = None) -> tuple[float, float]:
    """Least-squares line through ``(log rank, log value)`` over ranks ``[rank_lo, rank_hi]``.

    Parameters
    ----------
    values : array-like, shape (N,)
        Values in rank order (rank 1 first), e.g. a row of :func:`rank_frequency`.
    rank_lo, rank_hi : int
        Inclusive 1-based rank range; ``rank_hi=None`` means ``N``. Ranks whose
        value is not positive are left out.

    Returns
    -------
    alpha : float
        Fitted exponent: ``value ~ rank ** -alpha``.
    r2 : float
        Coefficient of determination of the fit in log-log space.
    """
    v = np.asarray(values, dtype=np.float64)
    ranks = np.arange(1, v.size + 1)
    hi = v.size if rank_hi is None else min(rank_hi, v.size)
    sel = (ranks >= rank_lo) & (ranks <= hi) & (v > 0)
    if sel.sum() < 3:
        raise ValueError(f"rank range: needs at least 3 positive values in [{rank_lo}, {hi}]")
    x, y = np.log(ranks[sel]), np.log(v[sel])
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    total = ((y - y.mean()) ** 2).sum()
    r2 = 1.0 - (resid**2).sum() / total if total > 0 else 1.0
    return float(-slope), float(r2)


def layer_power_law(attn: torch.Tensor, rank_lo: int = 2, rank_hi: int | None = None) -> dict:
    """Per-head power-law fits of one layer's accumulated attention.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)
    rank_lo, rank_hi : int
        Rank range of the fit; ``None`` for ``rank_hi`` means ``T // 2``.

    Returns
    -------
    dict
        ``alpha`` and ``r2``: lists of length H; ``curve``: the rank-frequency
        curve averaged over heads rank by rank, shape (T,) as a list.
    """
    freq = rank_frequency(attn)  # (H, T)
    hi = freq.shape[-1] // 2 if rank_hi is None else rank_hi
    fits = [fit_power_law(row.numpy(), rank_lo, hi) for row in freq]
    return {"alpha": [f[0] for f in fits], "r2": [f[1] for f in fits], "curve": freq.mean(0).tolist()}
