"""The core: eviction without a framework.

Settings and budgets, selection, per-token state, the methods and their
registry, the K/V stores and their registry, protection and the audit's
bookkeeping, and the budgeted layer that keeps them aligned. It imports torch
and nothing from transformers, vLLM, matplotlib, tqdm or gguf (a test imports it
with those blocked), so that any engine's adapter can drive it: the
transformers adapter is :mod:`scissorhands.hf`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_names

if TYPE_CHECKING:
    from .facts import ModelFacts
    from .layer.audit import EvictionAudit
    from .layer.budgeted import BudgetedKV
    from .methods import METHODS, EvictionMethod, LayerView, get_method, register
    from .planning.assembly import budget_tokens
    from .settings.config import DEFAULTS, CacheSettings, ScissorhandsConfig
    from .settings.schedule import layer_budgets
    from .tokens.protect import Protection
    from .tokens.state import TokenState

# Each public name and the module that defines it, imported on first use (PEP 562), so that
# importing the package (or a light module in it, such as the settings) does not import torch.
__getattr__ = lazy_names(__name__, globals(), {
    ".layer.audit": ("EvictionAudit",),
    ".planning.assembly": ("budget_tokens",),
    ".layer.budgeted": ("BudgetedKV",),
    ".settings.config": ("DEFAULTS", "CacheSettings", "ScissorhandsConfig",),
    ".facts": ("ModelFacts",),
    ".methods": ("METHODS", "EvictionMethod", "LayerView", "get_method", "register",),
    ".tokens.protect": ("Protection",),
    ".settings.schedule": ("layer_budgets",),
    ".tokens.state": ("TokenState",),
})


__all__ = [
    "DEFAULTS",
    "METHODS",
    "BudgetedKV",
    "CacheSettings",
    "EvictionAudit",
    "EvictionMethod",
    "LayerView",
    "ModelFacts",
    "Protection",
    "ScissorhandsConfig",
    "TokenState",
    "get_method",
    "layer_budgets",
    "register",
    "budget_tokens",
]
