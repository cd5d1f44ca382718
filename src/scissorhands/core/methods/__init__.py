"""Eviction methods: one small class per file, registered in :mod:`.registry`.

Adding a method is one new file: subclass :class:`EvictionMethod`, override
``score`` (and ``make_state`` if it needs per-token memory), decorate with
:func:`register`, and import the file below. See docs/usage.md, "Adding a method".
"""

from . import full, h2o, local, random, redundancy, scissorhands, streaming, tova  # noqa: F401  (each registers itself)
from .base import EvictionMethod, LayerView
from .registry import METHODS, get_method, methods_table, register, unregister

__all__ = ["METHODS", "EvictionMethod", "LayerView", "get_method", "methods_table", "register", "unregister"]
