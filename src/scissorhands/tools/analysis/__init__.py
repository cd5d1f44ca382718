"""Measurements behind Scissorhands: persistence of importance, attention power law,
calibrated per-layer budgets, and the deviation of compressed attention against the bound."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scissorhands.core.lazy import lazy_names

if TYPE_CHECKING:
    from .bound import deviation_vs_budget, kl_per_position, relative_l2
    from .calibrate import calibrated_budgets, save_schedule
    from .capture import attention_maps, capture_attention_outputs, eager_copy, full_attention_layers, random_copy
    from .persistence import layer_persistence, topk_persistence, union_persistence
    from .powerlaw import fit_power_law, rank_frequency
    from .settings import AnalysisSettings

# Each public name and the module that defines it, imported on first use (PEP 562), so that
# importing the package (or a light module in it, such as the settings) does not import torch.
__getattr__ = lazy_names(__name__, globals(), {
    ".bound": ("deviation_vs_budget", "kl_per_position", "relative_l2",),
    ".calibrate": ("calibrated_budgets", "save_schedule",),
    ".capture": ("attention_maps", "capture_attention_outputs", "eager_copy", "full_attention_layers", "random_copy",),
    ".persistence": ("layer_persistence", "topk_persistence", "union_persistence",),
    ".powerlaw": ("fit_power_law", "rank_frequency",),
    ".settings": ("AnalysisSettings",),
})


__all__ = [
    "AnalysisSettings",
    "attention_maps",
    "calibrated_budgets",
    "capture_attention_outputs",
    "deviation_vs_budget",
    "eager_copy",
    "fit_power_law",
    "full_attention_layers",
    "kl_per_position",
    "layer_persistence",
    "random_copy",
    "rank_frequency",
    "relative_l2",
    "save_schedule",
    "topk_persistence",
    "union_persistence",
]
