"""Facts about a model's attention layers, read once from its config.

Which layers attend over the full history (and get a budget), which keep a
native window (sliding or chunked attention, left to transformers), and the
K/V shapes. The cache, the evaluation and the analysis all read them here.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

FULL = "full_attention"
NATIVE_WINDOW_TYPES = ("sliding_attention", "chunked_attention")


def text_config(model_or_config):
    """The decoder's text config of a model or config (multimodal wrappers included)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class ModelFacts:
    """What the cache needs to know about a model's attention.

    Attributes
    ----------
    model_type : str
    layer_types : tuple of str
        One per decoder layer, as transformers names them.
    layer_kwargs : tuple of dict
        Per layer, what transformers' own cache layer for that type takes.
    num_kv_heads, head_dim : int
    max_positions : int or None
    """

    model_type: str
    layer_types: tuple[str, ...]
    layer_kwargs: tuple[dict, ...]
    num_kv_heads: int
    head_dim: int
    max_positions: int | None

    @property
    def full_layers(self) -> list[int]:
        """Indices of the layers that attend over the whole history: the budgeted ones."""
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def windowed_layers(self) -> list[int]:
        """Indices of the layers that keep a native window (sliding or chunked)."""
        return [i for i, t in enumerate(self.layer_types) if t in NATIVE_WINDOW_TYPES]

    @property
    def sliding_windows(self) -> list[int | None]:
        """Per layer: its sliding window, or None (full or chunked attention)."""
        return [kw.get("sliding_window") if t == "sliding_attention" else None
                for t, kw in zip(self.layer_types, self.layer_kwargs)]

    @property
    def signature(self) -> dict:
        """What a cache built for this model must match: layers, their types, K/V heads and size."""
        return {"layer_types": list(self.layer_types), "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}

    def kv_bytes_per_token(self, element_size: int, layers: str = "full") -> int:
        """Bytes of K and V one token costs, summed over the full-attention layers (or ``"all"``)."""
        n = len(self.full_layers) if layers == "full" else len(self.layer_types)
        return n * 2 * self.num_kv_heads * self.head_dim * element_size

    def check_supported(self) -> None:
        """Raise a one-line ``ValueError`` naming ``model`` if there is nothing this cache can budget."""
        unknown = sorted({t for t in self.layer_types if t != FULL and t not in NATIVE_WINDOW_TYPES})
        if unknown:
            raise ValueError(f"model: unsupported architecture {self.model_type!r} (layer types {unknown})")
        if not self.full_layers:
            raise ValueError(
                f"model: {self.model_type!r} has no full-attention layer (all keep a native window); "
                "there is nothing to budget"
            )


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
