"""Names of the built-in methods, without importing them (they import torch).

The command line's ``--help`` lists these, and must answer before torch is
imported. A test keeps this tuple equal to the built-in entries of
:data:`scissorhands.core.methods.METHODS`, in registry order.
"""

BUILTIN_METHODS = ("full", "scissorhands", "scissorhands-count", "h2o", "local", "random", "rkv", "streaming", "tova")


def method_names() -> str:
    """The methods for help texts: the built-in ones, and any registered since (once the registry is loaded)."""
    from .declare import named

    return ", ".join(dict.fromkeys((*BUILTIN_METHODS, *named("method", BUILTIN_METHODS))))
