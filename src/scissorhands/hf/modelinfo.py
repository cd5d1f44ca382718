"""Facts about a model's attention layers, read once from its config.

Which layers attend over the full history (and get a budget), which keep a
native window (sliding or chunked attention, left to transformers), and the
K/V shapes. The cache, the evaluation and the analysis all read them here.
"""

from __future__ import annotations

from transformers.cache_utils import get_layer_types_and_kwargs

from scissorhands.core.facts import FULL, NATIVE_WINDOW_TYPES, ModelFacts

__all__ = ["FULL", "NATIVE_WINDOW_TYPES", "ModelFacts", "model_facts", "text_config"]

def text_config(model_or_config):
    """The decoder's text config of a model or config (multimodal wrappers included)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def model_facts(model_or_config) -> ModelFacts:
    """Read :class:`ModelFacts` from a model or its config.

    Raises
    ------
    ValueError
        ``"model: ..."`` for encoder-decoder models.
    """
    config = getattr(model_or_config, "config", model_or_config)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model: unsupported architecture {config.model_type!r} (encoder-decoder)")
    cfg = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(cfg)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return ModelFacts(
        model_type=getattr(config, "model_type", "unknown"),
        layer_types=tuple(types),
        layer_kwargs=tuple(kwargs),
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_positions=getattr(cfg, "max_position_embeddings", None),
    )
