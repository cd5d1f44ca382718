"""scissorhands: budgeted KV-cache eviction by persistence of importance."""

from .attention import enable
from .audit import EvictionAudit
from .budget import resolve_budget
from .cache import ScissorhandsCache, ScissorhandsLayer
from .config import DEFAULTS, CacheSettings, ScissorhandsConfig
from .methods import METHODS, EvictionMethod, LayerView, get_method, register
from .protect import Protection
from .schedule import layer_budgets
from .state import TokenState

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
