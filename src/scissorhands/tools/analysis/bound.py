"""How far compressed attention drifts from the full cache as the budget shrinks.

For a budget ``B`` out of ``T`` tokens, the sequence is streamed once through
a :class:`~scissorhands.ScissorhandsCache` and once through the plain model
without a cache. Per layer, the attention module's output (captured with a
forward hook) is compared by relative L2; the final next-token distributions
are compared by KL divergence. The paper bounds the deviation by a term
proportional to ``1 - B/T``.

A layer's deviation includes what earlier layers passed on: its inputs
already differ, as they would in real use.
"""

from __future__ import annotations

import logging

import torch

from scissorhands.core.settings.config import DEFAULTS, CacheSettings
from scissorhands.hf.cache import ScissorhandsCache, cache_plan

from .capture import capture_attention_outputs

logger = logging.getLogger(__name__)


def relative_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` over all elements (0 when both are empty)."""
    denom = exact.float().norm()
    if exact.numel() == 0 or denom == 0:
        return 0.0
    return float((approx.float() - exact.float()).norm() / denom)


def kl_per_position(logits_p: torch.Tensor, logits_q: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """KL(p || q) of the next-token distributions at each position.

    Parameters
    ----------
    logits_p, logits_q : Tensor, shape (T, V)

    Returns
    -------
    Tensor, shape (T,), float32
    """
    out = []
    for s in range(0, logits_p.shape[0], chunk):  # bounded memory for large vocabularies
        lp = torch.log_softmax(logits_p[s:s + chunk].float(), -1)  # (c, V)
        lq = torch.log_softmax(logits_q[s:s + chunk].float(), -1)  # (c, V)
        out.append((lp.exp() * (lp - lq)).sum(-1).clamp(min=0))
    return torch.cat(out)


def fit_through_origin(x, y) -> tuple[float, float]:
    """Least-squares ``y = slope * x`` and its R² (against the mean of ``y``).

    Parameters
    ----------
    x, y : sequence of float, same length

    Returns
    -------
    slope, r2 : float
    """
    xs = torch.tensor(x, dtype=torch.float64)
    ys = torch.tensor(y, dtype=torch.float64)
    denom = float((xs * xs).sum())
    slope = float((xs * ys).sum()) / denom if denom > 0 else 0.0
    total = float(((ys - ys.mean()) ** 2).sum())
    resid = float(((ys - slope * xs) ** 2).sum())
    return slope, (1.0 - resid / total) if total > 0 else 1.0


@torch.no_grad()
def deviation_vs_budget(model, ids: torch.Tensor, ratios: list[float],
                        base: CacheSettings = DEFAULTS) -> list[dict]:
    """Per-layer attention-output deviation and next-token KL at each budget ratio.

    Parameters
    ----------
    model : PreTrainedModel
    ids : LongTensor, shape (T,) or (1, T)
    ratios : list of float
        Values of ``B/T`` in (0, 1].
    base : CacheSettings
        Cache settings other than the budget (the library defaults if not given).

    Returns
    -------
    list of dict, one per ratio
        ``ratio``, ``budget``; ``layer_rel_l2`` (one per layer, all positions),
        ``layer_rel_l2_evicted`` (positions ``t >= B`` only, where the cache
        has dropped something); ``kl`` and ``kl_evicted`` (mean KL of the
        next-token distributions over the same two position sets).
    """
    ids = ids.reshape(1, -1).to(model.device)  # (1, T)
    length = ids.shape[1]
    for ratio in ratios:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratios: must be in (0, 1], got {ratio}")
    with capture_attention_outputs(model) as outs:
        full_logits = model(ids, use_cache=False).logits[0]  # (T, V)
    full = [o[-1][0] for o in outs]  # per layer (T, hidden)
    results = []
    for ratio in ratios:
        made = cache_plan(model, base, budget=float(ratio), length=length)  # B/T = ratio, at least recent + 1
        budget = made.config.budget
        with capture_attention_outputs(model) as outs:
            logits = model(ids, cache=ScissorhandsCache.from_plan(model, made)).logits[0]  # (T, V)
        comp = [o[-1][0] for o in outs]
        kl = kl_per_position(full_logits, logits)  # (T,)
        start = min(budget, length)
        results.append({
            "ratio": ratio,
            "budget": budget,
            "layer_rel_l2": [relative_l2(c, f) for c, f in zip(comp, full)],
            "layer_rel_l2_evicted": [relative_l2(c[start:], f[start:]) for c, f in zip(comp, full)],
            "kl": float(kl.mean()),
            "kl_evicted": float(kl[start:].mean()) if start < length else 0.0,
        })
        logger.debug("B/T=%.2f budget %d: KL %.4g", ratio, budget, results[-1]["kl"])
    return results
