"""Names of a package imported on first use (PEP 562), so that importing the package imports none of them."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_names(package: str, namespace: dict, where: dict[str, tuple[str, ...]]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` that imports each name from its module when first read.

    ``where`` maps a module, relative to ``package`` (``".config"``), to the names it defines; a name,
    once read, is kept in ``namespace`` (the package's ``globals()``).
    """
    modules = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str):
        if name in modules:
            value = getattr(importlib.import_module(modules[name], package), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
