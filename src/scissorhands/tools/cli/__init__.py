"""Command line: builds configs and calls the library; no logic of its own.

One module per command (``generate`` and ``demo``, ``eval``, ``calibrate``; ``analyze``, ``bench``, ``build`` and
``heads`` live beside the tools they drive), the parser, the checks of the command line's own options, and
:mod:`.app`, which dispatches and ends every failure in one line. This file stays light, so that
``python -m scissorhands.tools.cli`` (:mod:`.__main__`) can take Ctrl-C in one line from its first import on; the
names below are imported on first use.
"""

from __future__ import annotations

import os
import sys

_LAZY = {"build_parser": "parser", "cache_settings": "parser", "job": "generate",
         "GenerateJob": "generate", "memory_line": "generate", "compare_lines": "generate", "say": "app",
         "first_line": "app", "in_flag_words": "app", "interrupt_in_finalizers": "app", "Terminated": "app"}

__all__ = ["main", *_LAZY]


def _interrupted_while_importing(signum, frame) -> None:
    """Ctrl-C before ``main`` runs (the modules below still importing): the command line's one line."""
    sys.stderr.write("\nscissorhands: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    """``scissorhands ...``: the exit code (see :func:`.app.main`)."""
    from .app import main as run

    return run(argv)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
