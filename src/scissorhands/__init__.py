"""scissorhands: budgeted KV-cache eviction by persistence of importance.

The core (:mod:`scissorhands.core`) knows no framework; the transformers
adapter (:mod:`scissorhands.hf`) is loaded on first use of its names, so that
``import scissorhands.core`` works without transformers installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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
        get_method,
        layer_budgets,
        register,
        resolve_budget,
    )
    from .hf import ScissorhandsCache, ScissorhandsLayer, enable

# Every public name is imported on first use (PEP 562): ``import scissorhands`` and the command line's
# ``--help`` do not import torch or transformers.
_ADAPTER_NAMES = {"ScissorhandsCache": "scissorhands.hf", "ScissorhandsLayer": "scissorhands.hf",
                  "enable": "scissorhands.hf"}
_CORE_NAMES = ("DEFAULTS", "METHODS", "CacheSettings", "EvictionAudit", "EvictionMethod", "LayerView", "Protection",
               "ScissorhandsConfig", "TokenState", "get_method", "layer_budgets", "register", "resolve_budget")


def __getattr__(name: str):
    where = _ADAPTER_NAMES.get(name, "scissorhands.core" if name in _CORE_NAMES else None)
    if where is not None:
        value = getattr(importlib.import_module(where), name)
        globals()[name] = value
        return value
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
