"""What one budgeted layer holds, in bytes and tokens, measured from tensor storage."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .budgeted import BudgetedKV


def layer_memory(kv: BudgetedKV) -> dict:
    """Bytes and tokens held by one budgeted layer.

    Returns
    -------
    dict
        ``budget``, ``stored`` (now), ``peak`` (ever), ``capacity`` (allocated
        slots), ``seen``; ``kv_bytes`` and its parts ``kv_data_bytes``
        (elements, packed or not), ``kv_scale_bytes`` (scales and
        zero-points), ``kv_residual_bytes`` (full-precision tokens of a packed
        store); ``importance_bytes`` (the method's per-token state),
        ``position_bytes``; ``full_kv_bytes`` and ``bf16_full_kv_bytes`` (what
        a full cache would hold for the tokens seen, in the model's dtype and
        in bfloat16); per stored token and KV head: ``kv_bytes_per_token_head``,
        ``importance_bytes_per_token_head``. With demotion (``kv_demote``):
        ``tokens_by_width`` (stored token and KV head pairs at each width now)
        and ``width_caps`` (each width's most tokens per row and KV head).
    """
    slots = kv.slots
    if not kv.allocated:
        return {"budget": kv.budget, "stored": 0, "peak": 0, "capacity": 0, "seen": 0, "kv_bytes": 0,
                "kv_data_bytes": 0, "kv_scale_bytes": 0, "kv_residual_bytes": 0, "importance_bytes": 0,
                "position_bytes": 0, "full_kv_bytes": 0, "bf16_full_kv_bytes": 0}
    heads = slots.positions.shape[1]
    per_token_head = kv.store.bytes_per_token_head()
    token_heads = int(slots.seen.sum()) * heads
    keys, values = kv.store.read(0)  # no slots: the compute dtype and head sizes, whatever the store

    def dense(dtype: torch.dtype) -> int:
        """What one token and KV head costs unpacked, K and V together, in ``dtype``."""
        return (keys.shape[-1] + values.shape[-1]) * torch.empty(0, dtype=dtype).element_size()

    report: dict = {
        "budget": kv.budget,
        "stored": slots.length,
        "peak": slots.peak,
        "capacity": kv.capacity,
        "seen": int(slots.seen.max()),
        "kv_bytes": kv.store.nbytes(),
        "kv_data_bytes": kv.store.data_bytes(),
        "kv_scale_bytes": kv.store.scale_bytes(),
        "kv_residual_bytes": kv.store.residual_bytes(),
        "importance_bytes": kv.state.nbytes(),
        "position_bytes": slots.positions.nbytes,
        "full_kv_bytes": token_heads * dense(keys.dtype),
        "bf16_full_kv_bytes": token_heads * dense(torch.bfloat16),
        "kv_bytes_per_token_head": per_token_head,
        "importance_bytes_per_token_head": kv.state.bytes_per_token_head(),
    }
    if kv.tiers is not None:
        # Stored (token, KV head) pairs at each width now, widest first, and each width's cap per row and head.
        widths = kv.tiers.slot_widths(slots.length)
        slot = torch.arange(slots.length, device=widths.device)
        real = slot[None, None, :] < slots.lengths.to(widths.device)[:, None, None]
        report["tokens_by_width"] = {str(w): int(((widths == w) & real).sum()) for w in kv.tiers.widths}
        report["width_caps"] = dict(zip((str(w) for w, _ in kv.tiers.tiers), kv.tiers.tier_caps))
    return report
