"""scissorhands: budgeted KV-cache eviction by persistence of importance."""

from .attention import enable
from .cache import ScissorhandsCache, ScissorhandsLayer
from .config import ScissorhandsConfig
from .policy import EvictionPolicy, ImportancePolicy
from .schedule import layer_budgets

__all__ = [
    "EvictionPolicy",
    "ImportancePolicy",
    "ScissorhandsCache",
    "ScissorhandsConfig",
    "ScissorhandsLayer",
    "enable",
    "layer_budgets",
]
__version__ = "0.1.0"
