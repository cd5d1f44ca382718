"""Where a budgeted layer keeps K and V: the store interface, the registry, and the shipped stores.

A store is registered by name, as a method is; the settings choose it
(``kv_store``; by default ``dense``, or ``packed`` when ``kv_bits`` is below
16), and the full-precision residual wraps whichever store that is. To add a
store, subclass :class:`~.base.KVStore`, set ``name``, override
``from_settings`` if it reads settings, and decorate it with
:func:`register_store`. The storage settings (``kv_*``) and their checks are
:mod:`scissorhands.core.settings.storage`. This package's names are imported on
first use, so importing one store's module imports no other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .base import DenseKVStore, KVStore, gather_rows
    from .packed import PackedKVStore
    from .registry import STORES, make_store, register_store, store_name, unregister_store
    from .residual import ResidualStore
    from .tiered import TieredKVStore

__getattr__ = lazy_names(__name__, globals(), {
    ".base": ("DenseKVStore", "KVStore", "gather_rows"),
    ".packed": ("PackedKVStore",),
    ".registry": ("STORES", "make_store", "register_store", "store_name", "unregister_store"),
    ".residual": ("ResidualStore",),
    ".tiered": ("TieredKVStore",),
})

__all__ = ["STORES", "DenseKVStore", "KVStore", "PackedKVStore", "ResidualStore", "TieredKVStore", "gather_rows",
           "make_store", "register_store", "store_name", "unregister_store"]
