"""TOVA: the latest query's attention alone decides, with no protected recent window."""

from .registry import register
from .scissorhands import Scissorhands


@register
class TOVA(Scissorhands):
    name = "tova"
    description = "the latest query's attention alone (w = 1), no recent window"
    settings = {"importance": "sum", "window": 1, "recent": 0}
