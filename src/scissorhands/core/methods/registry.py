"""The one place eviction methods are registered and looked up by name."""

from __future__ import annotations

from .base import EvictionMethod

METHODS: dict[str, type[EvictionMethod]] = {}


def register(cls: type[EvictionMethod]) -> type[EvictionMethod]:
    """Class decorator: make ``cls`` available as ``cls.name`` (CLI, evaluation, lm-eval backend)."""
    if not (isinstance(cls, type) and issubclass(cls, EvictionMethod)):
        raise TypeError(f"register: {cls!r} is not an EvictionMethod subclass")
    if not cls.name or cls.name == EvictionMethod.name:
        raise ValueError(f"register: {cls.__name__} needs a name")
    if cls.name in METHODS and METHODS[cls.name] is not cls:
        raise ValueError(f"register: a method named {cls.name!r} is already registered")
    METHODS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered method (for tests and experiments)."""
    METHODS.pop(name, None)


def get_method(name: str) -> type[EvictionMethod]:
    """The method class registered as ``name``; ``ValueError`` naming ``methods`` otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"methods: unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def methods_table() -> str:
    """Markdown table of the registered methods (the README's list is checked against it)."""
    lines = ["| method | keeps |", "|---|---|"]
    lines += [f"| `{name}` | {cls.description} |" for name, cls in METHODS.items()]
    return "\n".join(lines)
