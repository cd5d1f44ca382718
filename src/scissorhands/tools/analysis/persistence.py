"""Persistence of importance, measured on full attention-probability maps.

Both forms compare which of the first-half tokens matter to first-half
queries with which of them matter to second-half queries, per head.

Steps are 1-based: at step ``t`` the query at 0-based row ``t - 1`` attends
``n_t = t`` tokens (``min(t, window)`` for a sliding-window layer).

* Form (a), the paper's: ``P_t`` = keys whose probability at step ``t``
  exceeds ``multiple / n_t``; ``E`` = union of ``P_t`` for ``t <= T/2``;
  ``L`` = union of ``P_t`` for ``t > T/2``, restricted to keys ``[0, T/2)``;
  ratio = ``|L & E| / |L|`` (NaN when ``L`` is empty).
* Form (b), discriminative: the top ``k`` fraction of keys ``[0, T/2)``
  ranked by attention summed over first-half queries, against the top ``k``
  ranked by attention summed over second-half queries; ratio = overlap / count.
  Two random sets would overlap by ``k`` on average.
"""

from __future__ import annotations

import math

import torch


def attended_counts(length: int, window: int | None = None, device=None) -> torch.Tensor:
    """Number of tokens each query attends: ``n_t`` for rows ``0..T-1``.

    Returns
    -------
    Tensor, shape (T,), float32
    """
    steps = torch.arange(1, length + 1, dtype=torch.float32, device=device)  # (T,)
    return steps if window is None else steps.clamp(max=window)


def _visible(length: int, window: int | None, device=None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: ``[i, j]`` is True when query i sees key j.  (T, T) bool."""
    i = torch.arange(length, device=device).view(-1, 1)  # (T, 1)
    j = torch.arange(length, device=device).view(1, -1)  # (1, T)
    vis = j <= i
    if window is not None:
        vis &= (i - j) < window
    return vis


def union_persistence(attn: torch.Tensor, multiple: float = 1.0, window: int | None = None) -> dict[str, torch.Tensor]:
    """Form (a): the paper's persistence ratio, per head.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)
        Attention probabilities of one layer (rows are queries, causal).
    multiple : float
        Threshold as a multiple of ``1 / n_t``.
    window : int or None
        Sliding window of the layer, if any (sets ``n_t``).

    Returns
    -------
    dict of Tensor, each shape (H,)
        ``ratio``: ``|L & E| / |L|``, NaN where ``L`` is empty.
        ``coverage``: ``|E| / (T/2)``, the ratio a set ``L`` drawn at random
        from the first half would get (its chance level).
        ``late``: ``|L| / (T/2)``.
    """
    if multiple <= 0:
        raise ValueError(f"thresholds: must be > 0, got {multiple}")
    _, length, _ = attn.shape
    half = length // 2
    threshold = multiple / attended_counts(length, window, attn.device)  # (T,)
    heavy = attn > threshold.view(1, -1, 1)  # (H, T, T): P_t per row
    early = heavy[:, :half, :half].any(dim=1)  # (H, T/2): E
    late = heavy[:, half:, :half].any(dim=1)  # (H, T/2): L
    n_late = late.sum(-1).float()
    both = (early & late).sum(-1).float()
    ratio = torch.where(n_late > 0, both / n_late.clamp(min=1), torch.full_like(n_late, math.nan))
    return {"ratio": ratio, "coverage": early.float().mean(-1), "late": n_late / half}


def topk_count(half: int, k: float) -> int:
    """How many of ``half`` first-half tokens form the top ``k`` fraction (at least one)."""
    if not 0.0 < k <= 1.0:
        raise ValueError(f"topk: must be in (0, 100] percent, got {k * 100:g}")
    return max(1, round(k * half))


def _top_mask(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Boolean mask of the ``n`` highest scores per row.  scores (H, N) -> (H, N) bool."""
    idx = scores.topk(n, dim=-1).indices  # (H, n)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)


def half_scores(attn: torch.Tensor, normalise: bool = False,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that each first-half key gets from first-half and from second-half queries.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)
    normalise : bool
        False: plain sums over the queries (form (b)). True: the mean over the
        queries that can see the key of ``n_t * p``, attention relative to
        uniform. This removes the head start early keys get from being seen
        by more first-half queries.
    window : int or None
        Sliding window of the layer, if any.

    Returns
    -------
    first, second : Tensor, shape (H, T/2)
    """
    _, length, _ = attn.shape
    half = length // 2
    if not normalise:
        return attn[:, :half, :half].sum(1), attn[:, half:, :half].sum(1)
    rel = attn * attended_counts(length, window, attn.device).view(1, -1, 1)  # (H, T, T)
    vis = _visible(length, window, attn.device)[:, :half].float()  # (T, T/2)
    first = rel[:, :half, :half].sum(1) / vis[:half].sum(0).clamp(min=1)  # (H, T/2)
    second = rel[:, half:, :half].sum(1) / vis[half:].sum(0).clamp(min=1)  # (H, T/2)
    return first, second


def topk_persistence(attn: torch.Tensor, k: float = 0.1, normalise: bool = False,
                     window: int | None = None) -> torch.Tensor:
    """Form (b): overlap of the first-half top-k sets seen from each half, per head.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)
    k : float
        Fraction of the ``T/2`` first-half tokens in each top set, in (0, 1].
    normalise, window
        See :func:`half_scores`.

    Returns
    -------
    Tensor, shape (H,)
        ``|top_k(first) & top_k(second)| / n_k``; chance level is about ``k``.
    """
    first, second = half_scores(attn, normalise, window)
    n = topk_count(first.shape[-1], k)
    return (_top_mask(first, n) & _top_mask(second, n)).sum(-1).float() / n


def layer_persistence(attn: torch.Tensor, thresholds: list[float], topk: list[float],
                      window: int | None = None) -> dict[str, torch.Tensor]:
    """Every persistence measure of one layer, per head.

    Parameters
    ----------
    attn : Tensor, shape (H, T, T)
    thresholds : list of float
        Multiples of ``1 / n_t`` for form (a).
    topk : list of float
        Fractions for form (b) and its normalised variant.

    Returns
    -------
    dict of Tensor, each shape (H,)
        Keys ``a@{m}``, ``a_coverage@{m}``, ``a_late@{m}``, ``b@{k}``, ``bnorm@{k}``
        with ``m`` and ``k`` formatted by :func:`key`.
    """
    out: dict[str, torch.Tensor] = {}
    attn = attn.float()
    for m in thresholds:
        res = union_persistence(attn, m, window)
        out[key("a", m)] = res["ratio"]
        out[key("a_coverage", m)] = res["coverage"]
        out[key("a_late", m)] = res["late"]
    for k in topk:
        out[key("b", k)] = topk_persistence(attn, k, False, window)
        out[key("bnorm", k)] = topk_persistence(attn, k, True, window)
    return out


def key(form: str, value: float) -> str:
    """Result name for a form and its parameter, e.g. ``key("b", 0.1) == "b@0.1"``."""
    return f"{form}@{value:g}"
