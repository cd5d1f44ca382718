"""Random eviction, reproducible from a seed: the floor any scoring rule must beat."""

from __future__ import annotations

import torch

from .base import EvictionMethod, LayerView
from .registry import register


@register
class Random(EvictionMethod):
    """Each eviction draws fresh scores from a generator seeded by (seed, layer, eviction count).

    The draws do not depend on the order in which layers run, so blocked
    prefill and token-by-token decoding agree.
    """

    name = "random"
    description = "random eviction (seeded) + recent window"

    def score(self, view: LayerView) -> torch.Tensor:
        shape = view.positions.shape
        gen = torch.Generator().manual_seed(hash((self.seed, view.layer_idx, view.compressions)) % 2**63)
        return torch.rand(shape, generator=gen).to(view.positions.device)
