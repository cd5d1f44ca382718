"""StreamingLLM: a few attention-sink tokens at the start, then the most recent tokens."""

from __future__ import annotations

import torch

from .base import EvictionMethod, LayerView
from .registry import register


@register
class Streaming(EvictionMethod):
    name = "streaming"
    stackable = True  # rows alone, no layer index
    description = "StreamingLLM: 4 attention-sink tokens + the most recent tokens"
    sinks = 4

    def score(self, view: LayerView) -> torch.Tensor:
        pos = view.positions.to(torch.float32)  # (B, H_kv, L): older goes first
        return pos.masked_fill(pos < self.sinks, float("inf"))
