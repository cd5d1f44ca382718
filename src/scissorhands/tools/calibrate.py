"""Per-channel key centres for packed K/V, measured once per model on a calibration text.

Keys of a trained model carry a large, nearly constant offset in some
channels (RoPE's slowly rotating pairs), and that offset, not the spread,
sets the range of a per-token quantisation group. Subtracting each channel's
mean before quantising, and adding it back when reading, halves the 4-bit
loss on SmolLM2-135M at no per-token cost (docs/quantization.md). The means
are a property of the model, not of the text: measured on unrelated prose,
they work on Shakespeare.

The centres are per full-attention layer, KV head and channel, saved as JSON
with the model's attention signature, and given to the cache by path
(``kv_key_centers``). Each token is still quantised once, when written, and
stays a row that eviction moves by a gather; the exact scorer still equals
token-by-token decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.centers import FORMAT
from scissorhands.hf.modelinfo import model_facts


class KeyStats(DenseKVStore):
    """A dense store that also sums each KV head's keys per channel (for their mean)."""

    def __init__(self):
        super().__init__()
        self.count, self.total = 0, torch.zeros(())

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.count += key.shape[0] * key.shape[2]
        self.total = self.total + key.float().sum(dim=(0, 2))  # (H_kv, D)
        super().write(start, key, value)

    def mean(self) -> torch.Tensor:
        return self.total / max(self.count, 1)


def measure_key_centers(model, tokenizer, text: str, tokens: int = 2048) -> dict:
    """The per-channel mean of every full-attention layer's keys over the first ``tokens`` tokens of ``text``.

    Returns the JSON-ready record :func:`save_key_centers` writes.
    """
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.hf.cache import ScissorhandsCache

    ids = tokenizer(text)["input_ids"][:tokens]
    if len(ids) < 2:
        raise ValueError("text: the calibration text has fewer than 2 tokens")
    full = get_method("full")
    cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
    stores = []
    for layer in cache.budgeted_layers:
        layer.kv.store = KeyStats()
        stores.append(layer.kv.store)
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device), cache=cache, use_cache=True, logits_to_keep=1)
    facts = model_facts(model)
    return {"format": FORMAT, "signature": facts.signature, "tokens": len(ids),
            "layers": {str(i): s.mean().tolist() for i, s in zip(facts.full_layers, stores)}}


def save_key_centers(record: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(record))
