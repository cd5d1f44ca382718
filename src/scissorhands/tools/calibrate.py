"""Per-channel key centres for packed K/V, measured once per model on a calibration text.

Keys of a trained model carry a large, nearly constant offset in some
channels (RoPE's slowly rotating pairs), and that offset, not the spread,
sets the range of a per-token quantisation group. Subtracting each channel's
mean before quantising, and adding it back when reading, halves the 4-bit
loss on SmolLM2-135M at no per-token cost (docs/quantization.md). The means
are a property of the model, not of the text: measured on unrelated prose,
they work on Shakespeare.

A key projection with a bias (Qwen2) offsets every key by a constant *before*
RoPE, which RoPE turns into an offset rotating with the position: its mean
after RoPE is near zero, and a fixed centre removes little (a third of
Qwen2.5-Coder-0.5B's 4-bit loss). So where the model has a key bias, its RoPE
is static and every layer attends fully, the means are taken before RoPE (each
key rotated back from its position) and saved in the rotary frame (format 2;
``rotary=True`` asks for it without a bias, ``False`` never); the packed
store rotates them to each token's position (:mod:`scissorhands.core.stores.centers`).
That takes the same model's 4-bit loss from +0.55 to about +0.015 nats per token
(docs/quantization.md).

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

from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.centers import FORMAT, FORMAT_ROTARY, rope_angles, rotate_half
from scissorhands.hf.modelinfo import model_facts

#: RoPE types whose frequencies do not change with the length (transformers' ``rope_type``).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class KeyStats(DenseKVStore):
    """A dense store that also sums each KV head's keys per channel (for their mean).

    ``rope`` (inv_freq, scaling): each key is first rotated back from its
    position (one unpadded sequence, so slot = position) to before RoPE.
    """

    def __init__(self, rope: tuple[torch.Tensor, float] | None = None):
        super().__init__()
        self.count, self.total = 0, torch.zeros(())
        self.rope = rope

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        self.count += key.shape[0] * key.shape[2]
        k = key.float()
        if self.rope is not None:
            inv_freq, scaling = self.rope
            cos, sin = rope_angles(torch.arange(start, start + key.shape[2], device=key.device), inv_freq)
            k = (k * cos - rotate_half(k) * sin) / scaling  # R(p)^-1 of (scaling * R(p) k_before)
        self.total = self.total + k.sum(dim=(0, 2))  # (H_kv, D)
        super().write(start, key, value)

    def mean(self) -> torch.Tensor:
        return self.total / max(self.count, 1)


def key_bias(model) -> bool:
    """Whether the model's key projections carry a bias (``k_proj.bias``, as Qwen2's do)."""
    return any(name.endswith("k_proj") and getattr(m, "bias", None) is not None for name, m in model.named_modules())


def static_rope(model) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention scaling) of a model whose every layer attends fully with one static RoPE, else None."""
    facts = model_facts(model)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    freq = getattr(rotary, "inv_freq", None)
    if (rotary is None or not isinstance(freq, torch.Tensor) or getattr(rotary, "rope_type", None) not in STATIC_ROPE
            or len(facts.full_layers) != len(facts.layer_types) or tuple(freq.shape) != (facts.head_dim // 2,)):
        return None
    return freq.detach().float().cpu(), float(getattr(rotary, "attention_scaling", 1.0))


def measure_key_centers(model, tokenizer, text: str, tokens: int = 2048, rotary: bool | None = None) -> dict:
    """The per-channel mean of every full-attention layer's keys over the first ``tokens`` tokens of ``text``.

    ``rotary`` None: before RoPE where the model allows it (:func:`static_rope`) and its key projection has a
    bias (the offset that rotates, as Qwen2's), else after; True: before RoPE, or a one-line ``ValueError``;
    False: after.
    Returns the JSON-ready record :func:`save_key_centers` writes.
    """
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.hf.cache import ScissorhandsCache

    ids = tokenizer(text)["input_ids"][:tokens]
    if len(ids) < 2:
        raise ValueError("text: the calibration text has fewer than 2 tokens")
    rope = static_rope(model) if rotary is not False else None
    if rotary is None and not key_bias(model):
        rope = None  # no bias: measured on SmolLM2, fixed centres; rotary ones there are not measured
    if rotary and rope is None:
        raise ValueError("frame: this model's keys cannot be centred before RoPE (its RoPE changes with the length, "
                         "or some layers attend in a window); measure fixed centres")
    full = get_method("full")
    cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
    stores = []
    for layer in cache.budgeted_layers:
        kv = layer.kv
        assert isinstance(kv, BudgetedKV)  # the full cache above: one budget for every head
        kv.store = KeyStats(rope)
        stores.append(kv.store)
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device), cache=cache, use_cache=True, logits_to_keep=1)
    facts = model_facts(model)
    record = {"format": FORMAT if rope is None else FORMAT_ROTARY, "signature": facts.signature,
              "tokens": len(ids), "layers": {str(i): s.mean().tolist() for i, s in zip(facts.full_layers, stores)}}
    if rope is not None:
        record["rotary"] = {"inv_freq": rope[0].tolist(), "scaling": rope[1]}
    return record


def save_key_centers(record: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(record))
