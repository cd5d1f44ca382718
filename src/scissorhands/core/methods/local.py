"""Local window: the oldest token goes first."""

from __future__ import annotations

import torch

from .base import EvictionMethod, LayerView
from .registry import register


@register
class Local(EvictionMethod):
    name = "local"
    stackable = True  # rows alone, no layer index
    description = "the most recent tokens only"

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.to(torch.float32)
