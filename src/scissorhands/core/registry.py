"""A name -> class registry, shared by the plug-in axes: eviction methods, K/V stores, prefill and decode modes."""

from __future__ import annotations

from typing import Generic, TypeVar

from .settings.declare import disown, own

T = TypeVar("T", bound=type)


class Registry(dict, Generic[T]):
    """Classes by their ``name``; ``register`` is a class decorator, and a second class of one name is refused.

    Parameters
    ----------
    what : str
        How messages name the registering call (``"register"``, ``"register_store"``).
    base : type
        What a registered class must subclass; its own ``name`` is no name.
    axis : str, optional
        The setting that chooses among these plug-ins by name (``"prefill"``, ``"kv_store"``). A class
        registered here with a ``Settings`` dataclass of :func:`~.settings.declare.setting` fields owns those
        settings (:func:`~.settings.declare.own`) while it is registered.
    """

    def __init__(self, what: str, base: type, axis: str | None = None):
        super().__init__()
        self.what, self.base, self.axis = what, base, axis

    def register(self, cls: T) -> T:
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.what}: {cls!r} is not a {self.base.__name__} subclass")
        name = getattr(cls, "name", None)
        if not name or name == getattr(self.base, "name", None):
            raise ValueError(f"{self.what}: {cls.__name__} needs a name")
        if name in self and self[name] is not cls:
            raise ValueError(f"{self.what}: a {self.base.__name__} named {name!r} is already registered")
        settings = getattr(cls, "Settings", None)
        if settings is not None:
            if self.axis is None:
                raise TypeError(f"{self.what}: {cls.__name__}.Settings: this axis takes no settings of its own")
            own(self.axis, name, settings)
        self[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered class (for tests and experiments), and the settings it owned."""
        if self.pop(name, None) is not None and self.axis is not None:
            disown(self.axis, name)
