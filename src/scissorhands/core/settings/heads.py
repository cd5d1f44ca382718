"""The head settings: unequal budgets for a layer's KV heads, from a ranking measured once per model.

One group of :class:`~.config.CacheSettings`. With ``head_budgets`` (a file written by ``scissorhands heads``),
the KV heads that look furthest back (the *retrieval* heads, a share ``retrieval_share`` of all budgeted KV
heads, ranked across layers) keep a larger budget and the others (the *streaming* heads) keep attention sinks
and a recent window of ``head_window`` tokens, at the same total memory as the uniform cache. The arithmetic is
:mod:`scissorhands.core.planning.heads`. This module imports no torch.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from . import declare as s
from .declare import setting

DEFAULT_SHARE = 0.25
STREAMING_SINKS = 4  # StreamingLLM's attention sinks (methods/streaming.py), kept by every streaming head
# The ranking's measurement (scissorhands heads): the window a streaming head keeps while measured, and tokens
# run at once. With the 4 sinks, a 64-token window: DuoAttention's order of size for short text.
DEFAULT_RECENT = 60
DEFAULT_LENGTH = 1024
MIN_WINDOW = 8  # a streaming head keeps 4 attention sinks; a window must leave it recent tokens to drop


def _share(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: must be in (0, 1], got {value}")
    return float(value)


def _head_file(name, value):
    value = s.optional_path(name, value)
    if value is not None and not str(value).endswith(".json"):
        raise ValueError(f"{name}: must be a .json file written by `scissorhands heads`, got {value!r}")
    return None if value is None else str(value)


@dataclass(frozen=True)
class HeadSettings:
    """Budgets per KV head: retrieval heads keep more, streaming heads sinks and a window, the total unchanged."""

    head_budgets: str | None = setting(
        None, "a KV-head ranking (`scissorhands heads --out FILE.json`): the top `retrieval_share` of the budgeted "
        "KV heads keep a larger budget, the others 4 sinks and `head_window` recent tokens, at the uniform cache's "
        "total ([below](#head-level-budgets)); `None` = every head the layer's budget", s.parse_optional_text,
        _head_file, group="heads", metavar="FILE.json")
    retrieval_share: float = setting(
        DEFAULT_SHARE, "`head_budgets` only: the share of budgeted KV heads, ranked across layers, that are "
        "retrieval heads, in (0, 1] (1: every head the layer's budget)", s.parse_float, _share, group="heads",
        metavar="S")
    head_window: int | None = setting(
        None, "`head_budgets` only: tokens a streaming head holds (4 sinks and the most recent); `None` = the "
        f"layer's recent window plus its sinks, at least {MIN_WINDOW}", s.parse_optional_int,
        s.integer(MIN_WINDOW, allow_none=True), group="heads", metavar="W|none")

    def check(self) -> None:
        """The head settings other than the file mean nothing without it."""
        if self.head_budgets is None:
            for name, bad in (("retrieval_share", self.retrieval_share != DEFAULT_SHARE),
                              ("head_window", self.head_window is not None)):
                if bad:
                    raise ValueError(f"{name}: a setting of head_budgets=FILE.json, got head_budgets=None")
