"""The registered attention function that routes budgeted layers through their cache.

It is registered with transformers' ``AttentionInterface`` under the name
``"scissorhands"`` when :func:`enable` is called (never at import). For a
layer whose cache is a :class:`~scissorhands.hf.cache.ScissorhandsLayer`, the
cache layer computes the attention itself, because eviction needs the
probabilities of the new queries. Any other layer (sliding-window layers, or
a model run with a plain ``DynamicCache``) falls through to PyTorch SDPA.
"""

from __future__ import annotations

import logging

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

ATTENTION_NAME = "scissorhands"


def scissorhands_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    scissorhands_layer=None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer, in transformers' attention-interface signature.

    Parameters
    ----------
    query : Tensor, shape (B, H_q, T, D)
    key, value : Tensor, shape (B, H_kv, T_kv, D)
        For a budgeted layer: the new chunk only (the cache holds the rest).
    attention_mask : Tensor of bool, shape (B, 1, T, T_kv), or None
    scissorhands_layer : ScissorhandsLayer, optional
        Set by the cache layer's ``update`` through the model's kwargs.

    Returns
    -------
    (Tensor of shape (B, T, H_q, D), None)
    """
    if scissorhands_layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scissorhands_layer.check_model(module)  # a cache built for another model is a one-line error
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = scissorhands_layer.attend(query, key, value, attention_mask, scaling, softcap=kwargs.get("softcap"))
    return out.transpose(1, 2), None  # (B, T, H_q, D)


def register() -> None:
    """Make ``attn_implementation="scissorhands"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, scissorhands_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def enable(model) -> None:
    """Route ``model``'s attention through scissorhands.

    Layers without a scissorhands cache keep computing plain SDPA, so the model
    still runs unchanged with ``DynamicCache`` or no cache.
    """
    register()
    if model.config._attn_implementation != ATTENTION_NAME:
        logger.debug("switching attention from %s to %s", model.config._attn_implementation, ATTENTION_NAME)
        model.set_attn_implementation(ATTENTION_NAME)
