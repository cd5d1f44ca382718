"""Command-line pieces every subcommand shares: deprecated spellings that still work and say what to use."""

from __future__ import annotations

import argparse
import sys


class _Deprecated(argparse.Action):
    """An old option name: stores into the new option's destination and says, once, what to use instead."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"scissorhands: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def alias(group, old: str, new: str, dest: str) -> None:
    """Accept ``old`` for the option ``new`` (destination ``dest``), hidden from ``--help``."""
    group.add_argument(old, dest=dest, action=_Deprecated, new=new, help=argparse.SUPPRESS)
