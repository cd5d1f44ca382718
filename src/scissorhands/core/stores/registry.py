"""The stores' registry, the shipped stores registered in it, and the one function that makes a layer's store."""

from __future__ import annotations

import torch

from ..registry import Registry
from .base import DenseKVStore, KVStore
from .centers import RotaryCenters
from .packed import PackedKVStore
from .residual import ResidualStore
from .tiered import TieredKVStore

STORES: Registry[type[KVStore]] = Registry("register_store", KVStore, axis="kv_store")


def register_store(cls: type[KVStore]) -> type[KVStore]:
    """Class decorator: make ``cls`` available as ``kv_store=cls.name`` (with the settings its ``Settings``
    dataclass declares, if it has one: :class:`~scissorhands.core.registry.Registry`)."""
    return STORES.register(cls)


def unregister_store(name: str) -> None:
    """Remove a registered store (for tests and experiments)."""
    STORES.unregister(name)


def store_name(settings) -> str:
    """The store the settings ask for: ``kv_store``, else tiered with ``kv_demote``, else packed for ``kv_bits``
    below 16, else dense (:meth:`~scissorhands.core.settings.storage.StorageSettings.store`)."""
    return settings.store()


def make_store(settings, key_center: torch.Tensor | RotaryCenters | None = None, residual: int = 0) -> KVStore:
    """One layer's store for these settings, wrapped in a residual of ``residual`` tokens if that is > 0."""
    name = store_name(settings)
    if name not in STORES:
        raise ValueError(f"kv_store: unknown store {name!r}; choose from {', '.join(STORES)}")
    store = STORES[name].from_settings(settings, key_center)
    return ResidualStore(store, residual) if residual else store


register_store(DenseKVStore)
register_store(PackedKVStore)
register_store(TieredKVStore)
