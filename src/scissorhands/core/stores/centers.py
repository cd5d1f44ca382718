"""Per-channel key centres for packed K/V: the file format and its loading, checked against a model.

The centres are measured once per model (``scissorhands calibrate``, in the
tools) and given to a cache by path (``kv_key_centers``); keys are quantised
around them. See :mod:`scissorhands.tools.calibrate` for why they help.

Two frames:

* **fixed** (files of format 1): one offset per KV head and channel, taken off
  every key as it stands in the cache (after RoPE).
* **rotary** (format 2, :class:`RotaryCenters`): the mean of each channel
  *before* RoPE, rotated to each token's position. A key projection with a
  bias (Qwen2) adds a constant before RoPE, which RoPE turns into an offset
  that rotates with the position; a fixed centre averages it away, a rotated
  one follows it. The packed store keeps each slot's position for this
  (``wants_positions``), 4 bytes per token and KV head.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..facts import ModelFacts

FORMAT = "scissorhands-key-centers/1"
FORMAT_ROTARY = "scissorhands-key-centers/2"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's partner of each channel (transformers' convention: the two halves of the head pair up)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
    """cos and sin (..., D) of RoPE at integer ``positions`` (...), as transformers computes them in float32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class RotaryCenters:
    """One layer's key centres before RoPE: a token at position ``p`` is centred on the mean rotated to ``p``.

    Parameters
    ----------
    mean : Tensor
        (H_kv, D): each channel's mean before RoPE.
    inv_freq : Tensor
        (D / 2,): the model's RoPE frequencies (``rotary_emb.inv_freq``).
    scaling : float
        The model's RoPE attention scaling (1 for plain RoPE).
    """

    def __init__(self, mean: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.mean = mean.to(torch.float32)
        self.inv_freq = inv_freq.to(torch.float32)
        self.scaling = float(scaling)
        self._turned = rotate_half(self.mean)

    @property
    def shape(self) -> torch.Size:
        return self.mean.shape

    @property
    def nbytes(self) -> int:
        return self.mean.nbytes + self.inv_freq.nbytes

    def to(self, device) -> RotaryCenters:
        return RotaryCenters(self.mean.to(device), self.inv_freq.to(device), self.scaling)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The centres of tokens at ``positions`` (X, H_kv or 1, T): (X, H_kv, T, D) float32."""
        cos, sin = rope_angles(positions, self.inv_freq, self.scaling)  # (X, h, T, D)
        return self.mean[:, None, :] * cos + self._turned[:, None, :] * sin


def centers_frame(path: str | Path) -> str:
    """``"rotary"`` or ``"fixed"``: which frame a centre file's centres are in (``"fixed"`` if unreadable).

    Read once per file version: ``memory=``'s byte model asks at every budget it tries.
    """
    p = Path(path).expanduser()
    try:
        return _frame_of(str(p), p.stat().st_mtime_ns)
    except OSError:
        return "fixed"


@functools.lru_cache(maxsize=32)
def _frame_of(path: str, mtime_ns: int) -> str:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "fixed"
    return "rotary" if isinstance(record, dict) and record.get("format") == FORMAT_ROTARY else "fixed"


def load_key_centers(path: str | Path, facts: ModelFacts) -> dict[int, torch.Tensor | RotaryCenters]:
    """Centres per full-attention layer index, checked against the model's ``facts``.

    A format-1 file gives fixed centres, (H_kv, D) float32 tensors; a format-2
    file gives :class:`RotaryCenters`.

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
    if not isinstance(record, dict) or record.get("format") not in (FORMAT, FORMAT_ROTARY):
        raise ValueError(f"kv_key_centers: {str(path)!r} is not a key-centre file (see 'scissorhands calibrate')")
    if record.get("signature") != facts.signature:
        raise ValueError(f"kv_key_centers: {str(path)!r} was measured on another model (its attention layers differ)")
    layers = record.get("layers")
    if not isinstance(layers, dict):
        raise ValueError(f"kv_key_centers: {str(path)!r} has no per-layer centres (see 'scissorhands calibrate')")
    rotary = None
    if record["format"] == FORMAT_ROTARY:
        rope = record.get("rotary")
        freq: torch.Tensor | None = None
        scaling = 0.0
        try:
            if isinstance(rope, dict):
                freq = torch.tensor(rope["inv_freq"], dtype=torch.float32)
                scaling = float(rope["scaling"])
        except (TypeError, KeyError, ValueError):
            freq = None
        if freq is None or tuple(freq.shape) != (facts.head_dim // 2,) or not bool(freq.isfinite().all()) \
                or not 0 < scaling < float("inf"):
            raise ValueError(f"kv_key_centers: {str(path)!r} has no valid RoPE frequencies for its rotary centres")
        rotary = (freq, scaling)
    out: dict[int, torch.Tensor | RotaryCenters] = {}
    for i in facts.full_layers:
        rows = layers.get(str(i))
        try:
            t = torch.tensor(rows, dtype=torch.float32) if isinstance(rows, list) else None
        except (TypeError, ValueError):  # ragged or non-numeric lists
            t = None
        if t is None or tuple(t.shape) != (facts.num_kv_heads, facts.head_dim) or not bool(t.isfinite().all()):
            raise ValueError(f"kv_key_centers: {str(path)!r} has no valid centres for layer {i}")
        out[i] = t if rotary is None else RotaryCenters(t, *rotary)
    return out
