"""How to group K/V for quantisation: per-token groups along head_dim vs KIVI's per-channel keys, by paired NLL.

Full cache (no eviction), Shakespeare windows, paired against the bf16 full
cache of a ``defaults_sweep.py`` run (its ``.full.json``, same windows).

* ``token``: the library's packed store (keys and values in groups of
  ``group`` channels within each token); ``token:4:32:8`` gives keys 8 bits.
* ``keys`` / ``values``: only keys (or only values) quantised per token, the
  other kept exact: which of the two the loss comes from.
* ``calib``: per-token groups, after each key channel is centred and scaled by
  statistics measured once on a calibration text (``--calib-text``, not the
  evaluation text): ``(k - mean_c) / std_c`` is quantised and read back as
  ``q * std_c + mean_c``; ``calib-center`` only centres. Keys stay per token,
  so eviction could still move them as rows. Values per token as ``token``.
* ``rope-center``: per-token groups around a centre that rotates with each
  token's position. Each channel's mean is measured *before* RoPE (the keys
  read back and rotated to position 0), and a token at position ``p`` is
  quantised around that mean rotated to ``p``. A bias in the key projection
  (Qwen2) is a constant before RoPE and a rotating one after it, which a fixed
  centre cannot follow. ``rope-center16`` uses groups of 16 for the keys.
  ``rope-bias``: the same, with the key projection's bias as the mean (no
  calibration text).
* ``channel``: keys grouped per channel over ``group`` consecutive tokens,
  values per token (KIVI). Simulated in a dense store that quantises and
  dequantises each chunk as it is written; the last partial group of tokens
  stays in full precision (KIVI's residual). Within a group, a key is
  quantised with its group's later tokens known, which real KIVI (quantising a
  group once it is complete, and keeping the newest tokens exact) would not
  allow; it can only flatter the per-channel layout.

    python experiments/kv_grouping.py --variants token:4:32,channel:4:32 \
        --baseline docs/results/kvbits/grid.full.json --out docs/results/kvbits/grouping.jsonl
"""

import argparse
import json
import time
from pathlib import Path

import torch

from scissorhands import CacheSettings, ScissorhandsCache, get_method
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.centers import rope_angles, rotate_half
from scissorhands.core.stores.packed import dequantize, quantize
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup, token_logprobs
from scissorhands.tools.calibrate import KeyStats as CalibrationStats
from scissorhands.tools.eval.tasks import Perplexity
from scissorhands.tools.models import load_model
from scissorhands.tools.stats import paired_difference


def fake_quant(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Quantise and dequantise ``x`` (..., D) in groups of ``group`` along the last axis."""
    return dequantize(*quantize(x, bits, group), bits, group, x.dtype)


class OneSideStore(DenseKVStore):
    """Keys (``side="keys"``) or values quantised per token and dequantised; the other kept exact."""

    def __init__(self, bits: int, group: int, side: str):
        super().__init__()
        self.bits, self.group, self.side = bits, group, side

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.side == "keys":
            key = fake_quant(key, self.bits, min(self.group, key.shape[-1]))
        else:
            value = fake_quant(value, self.bits, min(self.group, value.shape[-1]))
        super().write(start, key, value)


class PerChannelKeyStore(DenseKVStore):
    """Dense storage of what KIVI's layout would read back: keys per channel over token groups, values per token."""

    def __init__(self, bits: int, group: int):
        super().__init__()
        self.bits, self.group = bits, group

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        b, h, c, d = key.shape  # (B, H_kv, c, D)
        whole = c // self.group * self.group
        key = key.clone()
        if whole:
            k = key[:, :, :whole].reshape(b, h, whole // self.group, self.group, d)  # (B, H_kv, n, G, D)
            k = fake_quant(k.transpose(-1, -2), self.bits, self.group).transpose(-1, -2)  # per channel over G tokens
            key[:, :, :whole] = k.reshape(b, h, whole, d)
        super().write(start, key, fake_quant(value, self.bits, min(32, value.shape[-1])))


class KeyStats(CalibrationStats):
    """The library's calibration store, also summing squares: each channel's spread as well as its mean."""

    def __init__(self):
        super().__init__()
        self.sq = torch.zeros(())

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.sq = self.sq + (key.float() ** 2).sum(dim=(0, 2))
        super().write(start, key, value)

    def stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.mean()
        return mean, (self.sq / self.count - mean * mean).clamp(min=1e-6).sqrt()


class CalibratedKeyStore(DenseKVStore):
    """Keys centred (and scaled) per channel by calibration statistics, then quantised per token; values per token."""

    def __init__(self, bits: int, group: int, mean: torch.Tensor, std: torch.Tensor | None):
        super().__init__()
        self.bits, self.group, self.mean, self.std = bits, group, mean[None, :, None], std
        if std is not None:
            self.std = std[None, :, None]

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k = key.float() - self.mean
        if self.std is not None:
            k = k / self.std
        k = fake_quant(k, self.bits, min(self.group, k.shape[-1]))
        if self.std is not None:
            k = k * self.std
        key = (k + self.mean).to(key.dtype)
        super().write(start, key, fake_quant(value, self.bits, min(self.group, value.shape[-1])))


def rope_tables(model, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D) of the model's rotary embedding at ``positions`` (transformers' convention)."""
    rot = model.model.rotary_emb
    return rope_angles(positions, rot.inv_freq, rot.attention_scaling)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, D) rotated by RoPE's angles (T, D); negate ``sin`` to rotate back."""
    return x * cos + rotate_half(x) * sin


class PreRopeStats(CalibrationStats):
    """The calibration store, summing each channel's keys rotated back to position 0 (a full cache: slot = position)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cos, sin = rope_tables(self.model, torch.arange(start, start + key.shape[2]))
        scaling = self.model.model.rotary_emb.attention_scaling  # the tables carry it once, the inverse twice
        super().write(start, rotate(key.float(), cos, -sin) / scaling**2, value)


class RopeCenteredKeyStore(DenseKVStore):
    """Keys quantised per token around the pre-RoPE mean rotated to each token's position; values per token."""

    def __init__(self, model, bits: int, group: int, mean: torch.Tensor, key_group: int):
        super().__init__()
        self.model, self.bits, self.group, self.key_group = model, bits, group, key_group
        self.mean = mean[None, :, None]  # (1, H_kv, 1, D)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        cos, sin = rope_tables(self.model, torch.arange(start, start + key.shape[2]))
        center = rotate(self.mean, cos, sin)  # (1, H_kv, c, D)
        k = fake_quant(key.float() - center, self.bits, min(self.key_group, key.shape[-1])) + center
        super().write(start, k.to(key.dtype), fake_quant(value, self.bits, min(self.group, value.shape[-1])))


def calibrate_pre_rope(model, tok, path: str, tokens: int = 2048) -> list[torch.Tensor]:
    """Per layer: each KV head's per-channel key mean before RoPE, over ``tokens`` tokens of a text."""
    full = get_method("full")
    ids = torch.tensor(tok(Path(path).read_text())["input_ids"][:tokens])
    cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
    stores = []
    for layer in cache.budgeted_layers:
        layer.kv.store = PreRopeStats(model)
        stores.append(layer.kv.store)
    token_logprobs(model, ids, ScoreSetup(full, None, CacheSettings()), cache=cache)
    return [s.mean() for s in stores]


def calibrate(model, tok, path: str, tokens: int = 2048) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: each KV head's per-channel key mean and standard deviation over ``tokens`` tokens of a text."""
    full = get_method("full")
    ids = torch.tensor(tok(Path(path).read_text())["input_ids"][:tokens])
    cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
    stores = []
    for layer in cache.budgeted_layers:
        layer.kv.store = KeyStats()
        stores.append(layer.kv.store)
    token_logprobs(model, ids, ScoreSetup(full, None, CacheSettings()), cache=cache)
    return [s.stats() for s in stores]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True,
                   help="comma list of layout:bits:group[:key_bits], layout = token | channel | keys | values")
    p.add_argument("--baseline", help="the .full.json of a defaults_sweep run (same windows); without it the "
                   "unquantised full cache is scored here, on --seq-len x --num-samples windows")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--num-samples", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calib-text", default="docs/appendix/performance_log.md",
                   help="text whose keys give the per-channel statistics of the calib layouts")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype)
    full = get_method("full")
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
    else:
        items = Perplexity(args.seq_len, args.num_samples).items(tok, None)
        nll = []
        for it in items:
            ids = torch.tensor(it.data["ids"])
            setup = ScoreSetup(full, None, CacheSettings())
            cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
            nll.append(float(-token_logprobs(model, ids, setup, cache=cache)[0].mean()))
        base = {"seq_len": args.seq_len, "num_samples": args.num_samples, "nll": nll}
        print(f"full cache: NLL {sum(nll) / len(nll):.4f}", flush=True)
    items = Perplexity(base["seq_len"], base["num_samples"]).items(tok, None)
    stats = calibrate(model, tok, args.calib_text) if "calib" in args.variants else None
    pre_rope = calibrate_pre_rope(model, tok, args.calib_text) if "rope-center" in args.variants else None
    for variant in args.variants.split(","):
        layout, bits, group, *key_bits = variant.split(":")
        start = time.perf_counter()
        nll = []
        for it in items:
            ids = torch.tensor(it.data["ids"])
            settings = CacheSettings()
            if layout == "token":
                settings = CacheSettings(kv_bits=int(bits), kv_group_size=int(group),
                                         kv_key_bits=int(key_bits[0]) if key_bits else None)
            setup = ScoreSetup(full, None, settings)
            cache = ScissorhandsCache(model, full.configure(settings, len(ids)), full())
            for layer in cache.budgeted_layers:
                if layout == "channel":
                    layer.kv.store = PerChannelKeyStore(int(bits), int(group))
                elif layout in ("keys", "values"):
                    layer.kv.store = OneSideStore(int(bits), int(group), layout)
                elif layout in ("calib", "calib-center"):
                    assert stats is not None
                    mean, std = stats[cache.budgeted_layers.index(layer)]
                    layer.kv.store = CalibratedKeyStore(int(bits), int(group), mean, std if layout == "calib" else None)
                elif layout == "rope-bias":
                    i = model_facts(model).full_layers[cache.budgeted_layers.index(layer)]
                    attn = model.model.layers[i].self_attn
                    bias = attn.k_proj.bias.detach().float().reshape(-1, attn.head_dim)
                    layer.kv.store = RopeCenteredKeyStore(model, int(bits), int(group), bias, int(group))
                elif layout in ("rope-center", "rope-center16"):
                    assert pre_rope is not None
                    i = cache.budgeted_layers.index(layer)
                    layer.kv.store = RopeCenteredKeyStore(model, int(bits), int(group), pre_rope[i],
                                                          16 if layout == "rope-center16" else int(group))
            lp, _ = token_logprobs(model, ids, setup, cache=cache)
            nll.append(float(-lp.mean()))
        delta, half = paired_difference(nll, base["nll"])
        rec = {"variant": variant, "layout": layout, "bits": int(bits), "group": int(group), "delta_nll": delta,
               "delta_nll_ci95": half, "nll": nll, "seq_len": base["seq_len"], "num_samples": len(items),
               "dtype": args.dtype, "wall_s": time.perf_counter() - start}
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{variant:<16} dNLL {delta:+.4f} ±{half:.4f} ({rec['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
