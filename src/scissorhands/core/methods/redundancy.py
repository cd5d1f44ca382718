"""Redundancy-aware scores: a token whose key a newer stored key repeats ranks lower (the idea of R-KV).

Long chains of reasoning repeat themselves, and a budget spent on near-copies of the same key holds less of what
was said. R-KV (Cai et al., 2025) ranks each token by its attention and by how redundant its key is among the
stored ones, and keeps the important and the unrepeated. Here the importance is the Scissorhands score over the
history window (normalised per row and KV head by its largest), the redundancy of a token the largest cosine
similarity of its key to the key of any *newer* stored token (so of two near-copies the newer stays), clamped
at 0, and the score

    ``share * importance + (1 - share) * (1 - redundancy)``

with ``share`` = 0.1, R-KV's weight of importance. A held prompt is judged as Scissorhands judges it (by its last
queries' attention): redundancy is a decode-time score.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import LayerView
from .registry import register
from .scissorhands import Scissorhands


def redundancy(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each slot's largest cosine similarity to a newer stored slot's key, at least 0 (0 for the newest).

    keys (B, H_kv, L, D), positions (B, H_kv, L) with -1 for empty slots -> float32 (B, H_kv, L).
    """
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    sim = unit @ unit.transpose(-1, -2)  # (B, H_kv, L, L)
    pos = positions.long()
    newer = (pos[..., None, :] > pos[..., :, None]) & (pos[..., None, :] >= 0)
    return sim.masked_fill(~newer, 0.0).amax(dim=-1).clamp(min=0.0)


@register
class RedundancyAware(Scissorhands):
    name = "rkv"
    description = ("importance less redundancy: a token whose key a newer stored key repeats ranks lower "
                   "(R-KV's idea over the Scissorhands score)")
    #: The weight of importance against redundancy (R-KV's lambda).
    share: ClassVar[float] = 0.1

    def score(self, view: LayerView) -> torch.Tensor:
        importance = super().score(view)  # (B, H_kv, L)
        if view.prompt_attention is not None:  # a held prompt: judged by its last queries' attention alone
            return importance
        top = importance.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        red = redundancy(view.keys(), view.positions)
        return self.share * (importance / top).float() + (1.0 - self.share) * (1.0 - red)
