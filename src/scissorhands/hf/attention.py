"""The registered attention function that routes budgeted layers through their cache.

It is registered with transformers' ``AttentionInterface`` under the name
``"scissorhands"`` when :class:`enable` is called (never at import). For a
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


class enable:
    """Route ``model``'s attention through scissorhands, now; as a context manager, only inside the block.

    Layers without a scissorhands cache keep computing plain SDPA, so the model still runs unchanged with
    ``DynamicCache`` or no cache. The switch is made when this is called; :meth:`restore` (or leaving a
    ``with`` block) puts back the implementation the model had before (a model that already ran through
    scissorhands stays so).

    Examples
    --------
    >>> with scissorhands.enable(model):
    ...     out = model.generate(**inputs, past_key_values=ScissorhandsCache(model, config))
    >>> model.config._attn_implementation   # back to what it was, e.g. "sdpa"
    """

    def __init__(self, model) -> None:
        if not hasattr(model, "set_attn_implementation"):
            raise ValueError(f"model: must be a transformers model, got {type(model).__name__}")
        register()
        self.model = model
        self.previous = model.config._attn_implementation
        if self.previous != ATTENTION_NAME:
            logger.debug("switching attention from %s to %s", self.previous, ATTENTION_NAME)
            model.set_attn_implementation(ATTENTION_NAME)

    def restore(self) -> None:
        """Put back the attention implementation the model had before this switch."""
        if self.model.config._attn_implementation != self.previous:
            self.model.set_attn_implementation(self.previous)

    def __deepcopy__(self, memo):
        return self  # a copied cache still belongs to the same model, and must not copy it

    def __enter__(self):
        return self.model

    def __exit__(self, *exc) -> None:
        self.restore()
