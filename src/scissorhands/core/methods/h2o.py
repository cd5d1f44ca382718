"""H2O (heavy hitters): attention accumulated over the whole history, plus the recent window."""

from .registry import register
from .scissorhands import Scissorhands


@register
class H2O(Scissorhands):
    name = "h2o"
    description = "attention accumulated over the whole history (w = inf) + recent window"
    settings = {"importance": "sum", "window": None}
