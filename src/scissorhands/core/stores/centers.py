"""Per-channel key centres for packed K/V: the file format and its loading, checked against a model.

The centres are measured once per model (``scissorhands calibrate``, in the
tools) and given to a cache by path (``kv_key_centers``); keys are quantised
around them. See :mod:`scissorhands.tools.calibrate` for why they help.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..facts import ModelFacts

FORMAT = "scissorhands-key-centers/1"


def load_key_centers(path: str | Path, facts: ModelFacts) -> dict[int, torch.Tensor]:
    """Centres per full-attention layer index, (H_kv, D) float32, checked against the model's ``facts``.

    Raises
    ------
    ValueError
        One line naming ``kv_key_centers`` for a missing, unreadable or foreign file.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"kv_key_centers: no such file {str(path)!r}")
    try:
        record = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"kv_key_centers: {str(path)!r} is not a key-centre file ({type(e).__name__})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"kv_key_centers: {str(path)!r} is not a key-centre file (see 'scissorhands calibrate')")
    if record.get("signature") != facts.signature:
        raise ValueError(f"kv_key_centers: {str(path)!r} was measured on another model (its attention layers differ)")
    layers = record.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"kv_key_centers: {str(path)!r} has no per-layer centres (see 'scissorhands calibrate')")
    out = {}
    for i in facts.full_layers:
        rows = layers.get(str(i))
        try:
            t = torch.tensor(rows, dtype=torch.float32) if isinstance(rows, list) else None
        except (TypeError, ValueError):  # ragged or non-numeric lists
            t = None
        if t is None or tuple(t.shape) != (facts.num_kv_heads, facts.head_dim) or not bool(t.isfinite().all()):
            raise ValueError(f"kv_key_centers: {str(path)!r} has no valid centres for layer {i}")
        out[i] = t
    return out
