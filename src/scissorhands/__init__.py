"""scissorhands: budgeted KV-cache eviction by persistence of importance.

The core (:mod:`scissorhands.core`) knows no framework; the transformers
adapter (:mod:`scissorhands.hf`) is loaded on first use of its names, so that
``import scissorhands.core`` works without transformers installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.lazy import lazy_names

if TYPE_CHECKING:
    from .core import (
        DEFAULTS,
        METHODS,
        CacheSettings,
        EvictionAudit,
        EvictionMethod,
        LayerView,
        Protection,
        ScissorhandsConfig,
        TokenState,
        budget_tokens,
        get_method,
        layer_budgets,
        register,
    )
    from .hf import ScissorhandsCache, ScissorhandsLayer, enable

# Every public name is imported on first use (PEP 562): ``import scissorhands`` and the command line's
# ``--help`` do not import torch or transformers.
__getattr__ = lazy_names(__name__, globals(), {
    "scissorhands.hf": ("ScissorhandsCache", "ScissorhandsLayer", "enable"),
    "scissorhands.core": ("DEFAULTS", "METHODS", "CacheSettings", "EvictionAudit", "EvictionMethod", "LayerView",
                          "Protection", "ScissorhandsConfig", "TokenState", "get_method", "layer_budgets", "register",
                          "budget_tokens"),
})


__all__ = [
    "DEFAULTS",
    "METHODS",
    "CacheSettings",
    "EvictionAudit",
    "EvictionMethod",
    "LayerView",
    "Protection",
    "ScissorhandsCache",
    "ScissorhandsConfig",
    "ScissorhandsLayer",
    "TokenState",
    "enable",
    "get_method",
    "layer_budgets",
    "register",
    "budget_tokens",
]
__version__ = "0.1.0"
