"""The full cache: no eviction, the reference every method is measured against."""

from .base import EvictionMethod
from .registry import register


@register
class Full(EvictionMethod):
    name = "full"
    description = "full cache, no eviction"
    is_full = True
    # Demotion ranks tokens by their scores, and the full cache scores none: it keeps every token at kv_bits.
    settings = {"kv_demote": None, "decode": "dynamic"}
