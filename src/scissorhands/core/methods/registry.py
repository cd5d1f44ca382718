"""The one place eviction methods are registered and looked up by name."""

from __future__ import annotations

from ..registry import Registry
from .base import EvictionMethod

METHODS: Registry[type[EvictionMethod]] = Registry("register", EvictionMethod, axis="method", settings=False)


def register(cls: type[EvictionMethod]) -> type[EvictionMethod]:
    """Class decorator: make ``cls`` available as ``cls.name`` (CLI, evaluation, lm-eval backend, vLLM)."""
    return METHODS.register(cls)


def unregister(name: str) -> None:
    """Remove a registered method (for tests and experiments)."""
    METHODS.unregister(name)


def get_method(name: str) -> type[EvictionMethod]:
    """The method class registered as ``name``; ``ValueError`` naming ``methods`` otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"methods: unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def methods_table() -> str:
    """Markdown table of the registered methods (docs/usage.md's list is checked against it)."""
    lines = ["| method | keeps |", "|---|---|"]
    lines += [f"| `{name}` | {cls.description} |" for name, cls in METHODS.items()]
    return "\n".join(lines)
