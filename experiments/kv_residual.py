"""Does a full-precision residual of the newest tokens help packed K/V? Measured by real token-by-token decoding.

A residual keeps the ``R`` most recent tokens of every layer exact and reads the older ones from their
quantised form, as KIVI does. Each query then sees exact K/V for the last ``R`` positions and quantised
K/V before them, which a blocked forward cannot reproduce, so this script decodes one token at a time
through a quantised full cache (no eviction) whose store mirrors every token both ways, and pairs each
variant's mean NLL per window with the unquantised cache's on the same windows.

    python experiments/kv_residual.py --windows 4 --seq-len 1024 --bits 4 --residuals 0,32,128 \
        --out docs/results/kvbits/residual.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from scissorhands import CacheSettings, ScissorhandsCache, get_method
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.stores.packed import dequantize, quantize
from scissorhands.tools.eval.tasks import Perplexity
from scissorhands.tools.models import load_model
from scissorhands.tools.stats import paired_difference


class ResidualStore(DenseKVStore):
    """Exact K/V, plus what a packed store would read back; ``read`` serves the newest ``residual`` slots exact."""

    def __init__(self, bits: int, group: int, residual: int):
        super().__init__()
        self.bits, self.group, self.residual = bits, group, residual
        self.qk = self.qv = torch.empty(0)

    def _fake(self, x: torch.Tensor) -> torch.Tensor:
        return dequantize(*quantize(x, self.bits, self.group), self.bits, self.group, x.dtype)

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        for name in ("qk", "qv"):
            src = getattr(self, name)
            out = self.keys.new_zeros(self.keys.shape[:2] + (capacity, self.keys.shape[-1]))
            if src.numel():
                keep = min(capacity, src.shape[-2])
                out[:, :, :keep] = src[:, :, :keep]
            setattr(self, name, out)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        super().write(start, key, value)
        c = key.shape[-2]
        self.qk[:, :, start:start + c] = self._fake(key)
        self.qv[:, :, start:start + c] = self._fake(value)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cut = max(0, length - self.residual)
        keys = torch.cat([self.qk[:, :, :cut], self.keys[:, :, cut:length]], dim=2)
        values = torch.cat([self.qv[:, :, :cut], self.values[:, :, cut:length]], dim=2)
        return keys, values


def decode_nll(model, ids: list[int], store_factory=None) -> float:
    full = get_method("full")
    cache = ScissorhandsCache(model, full.configure(CacheSettings(), len(ids)), full())
    if store_factory is not None:
        for layer in cache.budgeted_layers:
            layer.kv.store = store_factory()
    t = torch.tensor(ids)
    total = 0.0
    with torch.no_grad():
        for i in range(len(ids) - 1):
            logits = model(t[None, i:i + 1], cache=cache).logits[0, -1].float()
            total -= float(torch.log_softmax(logits, -1)[t[i + 1]])
    return total / (len(ids) - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--residuals", default="0,32,128")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype)
    items = Perplexity(args.seq_len, args.windows).items(tok, None)
    start = time.perf_counter()
    base = [decode_nll(model, it.data["ids"]) for it in items]
    rows = []
    for r in (int(x) for x in args.residuals.split(",")):
        nll = [decode_nll(model, it.data["ids"], lambda r=r: ResidualStore(args.bits, args.group, r)) for it in items]
        delta, half = paired_difference(nll, base)
        rows.append({"residual": r, "delta_nll": delta, "delta_nll_ci95": half, "nll": nll})
        print(f"residual {r:>4}: dNLL {delta:+.4f} ±{half:.4f}", flush=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "base_nll": base,
                                    "rows": rows, "wall_s": time.perf_counter() - start}, indent=1))


if __name__ == "__main__":
    main()
