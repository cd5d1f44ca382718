"""Scissorhands: keep the tokens that received the most attention over the last ``w`` steps."""

from __future__ import annotations

import torch

from ..settings.config import CacheSettings
from ..tokens.importance import ImportanceState
from .base import EvictionMethod, LayerView
from .registry import register


@register
class Scissorhands(EvictionMethod):
    name = "scissorhands"
    stackable = True  # rows alone, no layer index
    held_prompt_by_snapshot = True  # score() returns prompt_attention for a held prompt
    description = ("attention over the last w steps, in the configured importance form "
                   "(default: summed probabilities)")

    def make_state(self, config: CacheSettings) -> ImportanceState:
        return ImportanceState.from_settings(config)

    def score(self, view: LayerView) -> torch.Tensor:
        if view.prompt_attention is not None:  # a held prompt, judged by its last queries
            return view.prompt_attention
        state = view.state
        assert isinstance(state, ImportanceState)
        scores = state.scores(view.length)  # (B, H_kv, L)
        scores = state.ranked(scores, view.positions, view.seen)
        if state.value_weighted:
            scores = scores * view.values().to(scores.dtype).norm(dim=-1)
        return scores


@register
class ScissorhandsCount(Scissorhands):
    name = "scissorhands-count"
    description = "queries over the last w steps where attention exceeded 1/n (the official code's form)"
    settings = {"importance": "count"}
