"""Prefill time of one forward pass: SDPA (DynamicCache) against our streamed prefill with no eviction, per query tile.

    python experiments/prefill_tiles.py --tokens 2048 --tiles 256,128,64 --rounds 3

One thread; one warm-up round, then the variants interleaved; medians and the ratio to SDPA.
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from scissorhands import CacheSettings, ScissorhandsCache
from scissorhands.tools.models import load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--tiles", default="256,128,64")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = load_model("smollm2-135m")
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def run(cache) -> float:
        with torch.no_grad():
            start = time.perf_counter()
            model(input_ids=ids, cache=cache, logits_to_keep=1)
            return time.perf_counter() - start

    variants = {"sdpa": lambda: DynamicCache(config=model.config)}
    for tile in (int(x) for x in args.tiles.split(",")):
        variants[f"tile {tile}"] = (lambda tile=tile: ScissorhandsCache(
            model, CacheSettings(query_tile=tile).with_budget(args.tokens + 1)))
    for make in variants.values():
        run(make())
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, make in variants.items():
            times[name].append(run(make()))
    base = statistics.median(times["sdpa"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
