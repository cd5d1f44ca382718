"""scissorhands: budgeted KV-cache eviction by persistence of importance.

The core (:mod:`scissorhands.core`) knows no framework; the transformers
adapter (:mod:`scissorhands.hf`) is loaded on first use of its names, so that
``import scissorhands.core`` works without transformers installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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
    get_method,
    layer_budgets,
    register,
    resolve_budget,
)

if TYPE_CHECKING:
    from .hf import ScissorhandsCache, ScissorhandsLayer, enable

_ADAPTER_NAMES = {"ScissorhandsCache": "scissorhands.hf", "ScissorhandsLayer": "scissorhands.hf",
                  "enable": "scissorhands.hf"}


def __getattr__(name: str):
    if name in _ADAPTER_NAMES:
        return getattr(importlib.import_module(_ADAPTER_NAMES[name]), name)
    raise AttributeError(f"module 'scissorhands' has no attribute {name!r}")


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
    "resolve_budget",
]
__version__ = "0.1.0"
