"""The transformers adapter: cache layers over the core, the registered attention function, the exact scorer.

Only this package touches transformers. :class:`~scissorhands.hf.cache.ScissorhandsCache`
is a ``transformers.Cache`` whose full-attention layers each drive one
:class:`~scissorhands.core.layer.budgeted.BudgetedKV`.
"""

from .attention import enable
from .cache import ScissorhandsCache, ScissorhandsLayer

__all__ = ["ScissorhandsCache", "ScissorhandsLayer", "enable"]
