"""Time the vLLM adapter's attention over one long prompt, per layer: the compiled prompt operator over every
query (how a held prompt was attended before), the operator over the last ``observe`` queries with torch's fused
attention for the rest (how ``prompt.hold_fused`` attends it when nothing reads the first queries' probabilities), and
torch's fused attention alone (what a full cache's prefill pays for the same product, without probabilities).

Random queries, keys and values in a model's attention shape (default Qwen2.5-Coder-0.5B's: 14 query heads, 2
KV heads, 64 dimensions), float32. The variants alternate within each round; prints one JSON line per length
with each variant's median seconds, the spread over rounds, and each round's ratio to the fused attention.

    python experiments/vllm_prompt_pass.py --lengths 4096,8192 --rounds 5 --out docs/perf/vllm_prompt_pass.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from scissorhands.core.attend.prefill import causal_attention
from scissorhands.vllm import kernels


def _fused(q, k, v, scale, upto):
    """Torch's causal fused attention of queries ``0..upto-1``, as the plugin calls it, (upto, H_q, D)."""
    h, g, _, d = q.shape
    ctx = causal_attention(q[None, :, :, :upto], k[None, :, :upto], v[None, :, :upto], scale)
    return ctx[0].reshape(h * g, upto, d).transpose(0, 1)


def variants(q, k, v, scale, observe):
    h, g, t, d = q.shape
    head = max(0, t - observe)

    def operator_all():
        kernels.prompt(q, k, v, torch.empty(t, h * g, d), None, torch.empty(h, t), scale, None, False, None, head)

    def operator_tail():
        out = torch.empty(t, h * g, d)
        out[:head] = _fused(q, k, v, scale, head)
        tail = torch.empty(t - head, h * g, d)
        kernels.prompt(q[:, :, head:].contiguous(), k, v, tail, None, torch.empty(h, t), scale, None, False, None,
                       head)
        out[head:] = tail

    def fused_only():
        _fused(q, k, v, scale, t)

    return {"operator, every query": operator_all, "operator, last queries + fused": operator_tail,
            "fused attention": fused_only}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--observe", type=int, default=32, help="queries whose probabilities score the prompt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the lines to this file")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        raise SystemExit(f"--lengths: comma-separated token counts, not {args.lengths!r}") from None
    if min(lengths) < 2 or args.heads % args.kv_heads or args.rounds < 1 or args.observe < 1:
        raise SystemExit("--lengths: at least 2; --heads: a multiple of --kv-heads; --rounds, --observe: >= 1")
    torch.set_num_threads(args.threads)
    kernels.build()
    lines = []
    for t in lengths:
        gen = torch.Generator().manual_seed(t)
        h, g, d = args.kv_heads, args.heads // args.kv_heads, args.head_size
        q = torch.randn(h, g, t, d, generator=gen)
        k, v = torch.randn(h, t, d, generator=gen), torch.randn(h, t, d, generator=gen)
        runs = variants(q, k, v, d ** -0.5, args.observe)
        for run in runs.values():  # warm up
            run()
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
        base = seconds["fused attention"]
        line = {"length": t, "heads": args.heads, "kv_heads": args.kv_heads, "head_size": d,
                "observe": args.observe, "threads": args.threads, "rounds": args.rounds,
                "median_s": {n: statistics.median(s) for n, s in seconds.items()},
                "range_s": {n: [min(s), max(s)] for n, s in seconds.items()},
                "ratio_to_fused": {n: [round(a / b, 3) for a, b in zip(s, base)] for n, s in seconds.items()
                                   if n != "fused attention"}}
        print(json.dumps(line), flush=True)
        lines.append(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))


if __name__ == "__main__":
    main()
