"""A name -> class registry, shared by the eviction methods and the K/V stores (each a plug-in by name)."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(dict, Generic[T]):
    """Classes by their ``name``; ``register`` is a class decorator, and a second class of one name is refused.

    Parameters
    ----------
    what : str
        How messages name the registering call (``"register"``, ``"register_store"``).
    base : type
        What a registered class must subclass; its own ``name`` is no name.
    """

    def __init__(self, what: str, base: type):
        super().__init__()
        self.what, self.base = what, base

    def register(self, cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.what}: {cls!r} is not a {self.base.__name__} subclass")
        name = getattr(cls, "name", None)
        if not name or name == getattr(self.base, "name", None):
            raise ValueError(f"{self.what}: {cls.__name__} needs a name")
        if name in self and self[name] is not cls:
            raise ValueError(f"{self.what}: a {self.base.__name__} named {name!r} is already registered")
        self[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered class (for tests and experiments)."""
        self.pop(name, None)
