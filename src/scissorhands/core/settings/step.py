"""The step settings: how a layer's decode step runs, and how many queries a block scores at once.

One group of :class:`~.config.CacheSettings`; the decode modes it names are
:mod:`scissorhands.core.layer.decode`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import declare as s
from .declare import setting

DECODE_MODES = ("dynamic", "static", "compiled")  # the shipped modes; any registered one is taken (layer/decode.py)


_decode_name = s.registered("decode", DECODE_MODES, "decode mode")


@dataclass(frozen=True)
class StepSettings:
    """How the layer's steps run: the decode mode and the query tile (they change no kept token)."""

    query_tile: int = setting(64, "most query rows scored at once (bounds a block's probabilities to tile x budget)",
                              s.parse_int, s.integer(1), metavar="N")
    decode: str = setting(
        "dynamic", '`"dynamic"` (compact slots planned on the host), `"static"` (fixed shapes and no host '
        'synchronisation: ready for GPUs and graph capture) or `"compiled"` (the static step under `torch.compile`); '
        "the same tokens are kept ([below](#a-decode-step-with-fixed-shapes))", s.parse_text,
        _decode_name, metavar="|".join(DECODE_MODES))
