"""Measurements behind Scissorhands: persistence of importance, attention power law,
calibrated per-layer budgets, and the deviation of compressed attention against the bound."""

from .bound import deviation_vs_budget, kl_per_position, relative_l2
from .calibrate import calibrated_budgets, save_schedule
from .capture import attention_maps, capture_attention_outputs, eager_copy, full_attention_layers, random_copy
from .persistence import layer_persistence, topk_persistence, union_persistence
from .powerlaw import fit_power_law, rank_frequency
from .settings import AnalysisSettings

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
