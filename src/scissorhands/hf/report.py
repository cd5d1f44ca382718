"""Memory reports of a whole transformers cache: every layer, budgeted or sliding, measured from tensor storage."""

from __future__ import annotations


def cache_memory_report(cache) -> dict:
    """K/V, per-token state and position bytes, and tokens stored, per layer and in total.

    Returns
    -------
    dict
        ``layers``: one dict per layer (budgeted layers have ``budget``);
        totals ``kv_bytes`` (allocated), ``budgeted_kv_bytes`` and its parts
        ``kv_data_bytes``, ``kv_scale_bytes``, ``kv_residual_bytes``;
        ``importance_bytes``, ``position_bytes``, ``full_kv_bytes`` and
        ``bf16_full_kv_bytes`` (what a full cache would hold for the budgeted
        layers, in the model's dtype and in bfloat16); the reductions against
        that bfloat16 full cache, ``kv_reduction_vs_bf16`` (K/V bytes only)
        and ``total_reduction_vs_bf16`` (K/V, importance state and positions);
        ``max_stored`` (now), ``peak_stored`` (ever, in any layer) and
        ``stored_per_layer``.

        The whole model, every layer counted: ``model_kv_bytes`` (K/V held),
        ``model_full_kv_bytes`` (what ``DynamicCache`` would hold for the same
        tokens: every token seen in a budgeted layer, and a layer without a
        budget counted at its own bytes on both sides, since it is the same
        layer type holding the same native window), ``other_kv_bytes`` (the
        layers without a budget), ``model_compression`` (full / held over the
        whole model) and ``budgeted_compression`` (over the budgeted layers
        only). A layer without a budget also reports ``full_kv_bytes`` (its
        own bytes) and ``storage_bytes``: the storage its K/V views keep alive
        (transformers' sliding layer keeps a view of its last window - 1 tokens
        into a tensor one chunk longer).
    """
    per_layer = []
    for layer in cache.layers:
        if hasattr(layer, "kv"):
            per_layer.append(layer.memory())
        else:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            kv = 0 if keys is None or values is None else keys.nbytes + values.nbytes
            stored = 0 if keys is None or keys.numel() == 0 else keys.shape[-2]
            per_layer.append({"sliding_window": getattr(layer, "sliding_window", None), "stored": stored,
                              "kv_bytes": kv, "full_kv_bytes": kv, "storage_bytes": _storage_bytes(keys, values)})
    budgeted = [m for m in per_layer if "budget" in m]
    total: dict = {key: sum(m.get(key, 0) for m in per_layer)
                   for key in ("kv_bytes", "importance_bytes", "position_bytes")}
    for key in ("full_kv_bytes", "bf16_full_kv_bytes", "kv_data_bytes", "kv_scale_bytes", "kv_residual_bytes"):
        total[key] = sum(m[key] for m in budgeted)
    total["budgeted_kv_bytes"] = sum(m["kv_bytes"] for m in budgeted)
    held = total["budgeted_kv_bytes"]
    bf16 = total["bf16_full_kv_bytes"]
    total["kv_reduction_vs_bf16"] = bf16 / held if held else float("nan")
    everything = held + total["importance_bytes"] + total["position_bytes"]
    total["total_reduction_vs_bf16"] = bf16 / everything if everything else float("nan")
    total["max_stored"] = max(m["stored"] for m in budgeted)
    total["peak_stored"] = max(m["peak"] for m in budgeted)
    total["stored_per_layer"] = [m["stored"] for m in per_layer]
    tiered = [m["tokens_by_width"] for m in budgeted if "tokens_by_width" in m]
    if tiered:
        total["tokens_by_width"] = {w: sum(t[w] for t in tiered) for w in tiered[0]}
    total["layers"] = per_layer
    total.update(_whole_model(per_layer))
    return total


def _whole_model(per_layer: list[dict]) -> dict:
    """Every layer, not only the budgeted ones: what the model's KV costs against a full cache.

    A layer without a budget (a sliding-window layer, for example) is the very
    layer type transformers' ``DynamicCache`` builds for it, holding the same
    tokens (its native window, capped the same way), so it adds its own real
    K/V bytes to both sides. The budgeted layers add their buffers to the held
    side and ``full_kv_bytes`` (every token seen) to the full side.
    """
    budgeted = [m for m in per_layer if "budget" in m]
    other = sum(m["kv_bytes"] for m in per_layer if "budget" not in m)
    held_budgeted = sum(m["kv_bytes"] for m in budgeted)
    full_budgeted = sum(m["full_kv_bytes"] for m in budgeted)
    held, full = held_budgeted + other, full_budgeted + other
    return {
        "model_kv_bytes": held,
        "model_full_kv_bytes": full,
        "other_kv_bytes": other,
        "model_compression": full / held if held else 1.0,
        "budgeted_compression": full_budgeted / held_budgeted if held_budgeted else 1.0,
    }


def _storage_bytes(*tensors) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (a view keeps its whole base alive)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
