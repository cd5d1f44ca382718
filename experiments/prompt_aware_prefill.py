"""Time one prompt-aware prefill against the full cache's (SDPA) prefill of the same prompt, in one process.

Prints one JSON line: the prompt length, each prefill's seconds and their ratio. Run it from two trees in
turn (before, after, before, after) to compare a change to the held prompt's attention.

    python experiments/prompt_aware_prefill.py --model qwen2.5-coder-0.5b --length 8192 --budget 0.2
"""

import argparse
import json
import time

import torch
from transformers import DynamicCache

from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.tools.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--length", type=int, default=8192, help="prompt tokens (random ids)")
    p.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt each layer keeps")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.length < 2 or not 0 < args.budget < 1:
        raise SystemExit("--length: at least 2 tokens; --budget: a fraction between 0 and 1")
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0))
    seconds = {}
    with torch.no_grad():
        model(ids[:, :256], cache=DynamicCache(config=model.config), logits_to_keep=1)  # warm up
        for name in ("full", "prompt-aware"):
            cache = DynamicCache(config=model.config) if name == "full" else ScissorhandsCache(
                model, ScissorhandsConfig(budget=int(args.budget * args.length), prefill="prompt-aware"))
            start = time.perf_counter()
            model(ids, cache=cache, logits_to_keep=1)
            seconds[name] = time.perf_counter() - start
    print(json.dumps({"length": args.length, **seconds, "ratio": seconds["prompt-aware"] / seconds["full"]}))


if __name__ == "__main__":
    main()
