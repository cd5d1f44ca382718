"""Memory reports: what a budgeted cache holds, in bytes and tokens, measured from tensor storage."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .budgeted import BudgetedKV
    from .cache import ScissorhandsCache


def layer_memory(kv: BudgetedKV) -> dict:
    """Bytes and tokens held by one budgeted layer.

    Returns
    -------
    dict
        ``budget``, ``stored`` (now), ``peak`` (ever), ``capacity`` (allocated
        slots), ``seen``; ``kv_bytes``, ``importance_bytes`` (the method's
        per-token state), ``position_bytes``, and ``full_kv_bytes`` (what a
        full cache would hold for the tokens seen); per stored token and KV
        head: ``kv_bytes_per_token_head``, ``importance_bytes_per_token_head``.
    """
    slots = kv.slots
    if not kv.allocated:
        return {"budget": kv.budget, "stored": 0, "peak": 0, "capacity": 0, "seen": 0, "kv_bytes": 0,
                "importance_bytes": 0, "position_bytes": 0, "full_kv_bytes": 0}
    heads = slots.positions.shape[1]
    per_token_head = kv.store.bytes_per_token_head()
    return {
        "budget": kv.budget,
        "stored": slots.length,
        "peak": slots.peak,
        "capacity": kv.capacity,
        "seen": int(slots.seen.max()),
        "kv_bytes": kv.store.nbytes(),
        "importance_bytes": kv.state.nbytes(),
        "position_bytes": slots.positions.nbytes,
        "full_kv_bytes": int(slots.seen.sum()) * heads * per_token_head,
        "kv_bytes_per_token_head": per_token_head,
        "importance_bytes_per_token_head": kv.state.bytes_per_token_head(),
    }


def cache_memory_report(cache: ScissorhandsCache) -> dict:
    """K/V, per-token state and position bytes, and tokens stored, per layer and in total.

    Returns
    -------
    dict
        ``layers``: one dict per layer (budgeted layers have ``budget``);
        totals ``kv_bytes`` (allocated), ``budgeted_kv_bytes``,
        ``importance_bytes``, ``position_bytes``, ``full_kv_bytes`` (what a
        full cache would hold for the budgeted layers), ``max_stored`` (now),
        ``peak_stored`` (ever, in any layer) and ``stored_per_layer``.
    """
    per_layer = []
    for layer in cache.layers:
        if hasattr(layer, "kv"):
            per_layer.append(layer_memory(layer.kv))
        else:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            kv = 0 if keys is None or values is None else keys.nbytes + values.nbytes
            stored = 0 if keys is None or keys.numel() == 0 else keys.shape[-2]
            per_layer.append({"sliding_window": getattr(layer, "sliding_window", None), "stored": stored,
                              "kv_bytes": kv})
    budgeted = [m for m in per_layer if "budget" in m]
    total: dict = {key: sum(m.get(key, 0) for m in per_layer)
                   for key in ("kv_bytes", "importance_bytes", "position_bytes")}
    total["full_kv_bytes"] = sum(m["full_kv_bytes"] for m in budgeted)
    total["budgeted_kv_bytes"] = sum(m["kv_bytes"] for m in budgeted)
    total["max_stored"] = max(m["stored"] for m in budgeted)
    total["peak_stored"] = max(m["peak"] for m in budgeted)
    total["stored_per_layer"] = [m["stored"] for m in per_layer]
    total["layers"] = per_layer
    return total
