"""Facts about a model's attention that the core needs, whichever engine runs the model.

Which layers attend over the full history (and get a budget), which keep a
native window (sliding or chunked attention, left to the engine), and the K/V
shapes. An adapter reads them from its framework's config (the transformers
adapter: :func:`scissorhands.hf.modelinfo.model_facts`).
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = "full_attention"
NATIVE_WINDOW_TYPES = ("sliding_attention", "chunked_attention")


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
