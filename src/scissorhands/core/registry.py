"""A name -> class registry, shared by the plug-in axes: eviction methods, K/V stores, prefill and decode modes."""

from __future__ import annotations

from typing import Generic, TypeVar

from .settings.declare import NAMES, disown, own

T = TypeVar("T", bound=type)


class Registry(dict, Generic[T]):
    """Classes by their ``name``; ``register`` is a class decorator, and a second class of one name is refused.

    Parameters
    ----------
    what : str
        How messages name the registering call (``"register"``, ``"register_store"``).
    base : type
        What a registered class must subclass; its own ``name`` is no name.
    axis : str
        The setting that chooses among these plug-ins by name (``"prefill"``, ``"kv_store"``, ``"method"``): the
        names registered are kept under it in :data:`~.settings.declare.NAMES`, where the settings read them.
    settings : bool
        A class registered here with a ``Settings`` dataclass of :func:`~.settings.declare.setting` fields owns
        those settings (:func:`~.settings.declare.own`) while it is registered; False: this axis takes none.
    """

    def __init__(self, what: str, base: type, axis: str, settings: bool = True):
        super().__init__()
        self.what, self.base, self.axis, self.settings = what, base, axis, settings
        self.names = NAMES.setdefault(axis, [])

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
            if not self.settings:
                raise TypeError(f"{self.what}: {cls.__name__}.Settings: this axis takes no settings of its own")
            own(self.axis, name, settings)
        self[name] = cls
        if name not in self.names:
            self.names.append(name)
        return cls

    def unregister(self, name: str) -> None:
        """Remove a registered class (for tests and experiments), and the settings it owned."""
        if self.pop(name, None) is not None:
            if name in self.names:
                self.names.remove(name)
            if self.settings:
                disown(self.axis, name)
