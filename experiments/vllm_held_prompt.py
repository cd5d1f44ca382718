"""What a held prompt (``prefill="keep-prompt"``) costs the plugin's layer, offline: one ``PagedLayer.step`` over
a request's first chunk, in one layer of a model's attention shape, on vLLM-shaped blocks (no engine).

Three kinds of first chunk, each timed in the same process:

* a new request whose prompt vLLM's prefix cache partly holds (``--cached`` tokens): the step computes the rest,
  and the plugin attends it in one fused call (``prompt.held_whole``);
* the same with the fused call turned off: the core's one-row layer over every position, the cached ones as zero
  queries (what the plugin did before);
* a preempted request begun again: its held prompt, then ``G`` generated tokens recomputed, which stream into the
  window in rounds through the core's one-row layer (``--generated``).

    python experiments/vllm_held_prompt.py --prompt 350 --cached 256 --generated 100,200

Prints each kind's median milliseconds over ``--repeats`` calls (after one warm-up), float32 or bf16 K/V.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from unittest import mock

import torch

from scissorhands.vllm import prompt as prompt_path
from scissorhands.vllm.blocks import write_kv
from scissorhands.vllm.paged import PagedLayer
from scissorhands.vllm.planner import Planner
from scissorhands.vllm.settings import parse


def one_step(settings, heads: tuple[int, int, int], block: int, length: int, cached: int, held: int,
             dtype: torch.dtype) -> float:
    """Seconds of one layer's step over a request's first chunk: ``length`` tokens, the first ``cached`` from the
    prefix cache, ``held`` of them its held prompt (less than ``length``: a request begun again)."""
    hq, hkv, d = heads
    blocks = -(-(length + 1) // block)
    cache = torch.zeros(blocks, hkv, block, 2 * d, dtype=dtype)
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).view(1, blocks).to(torch.int32)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    slots = table[0, torch.arange(length) // block].long() * block + torch.arange(length) % block
    write_kv(cache, "vec", (slots // block)[:, None], torch.arange(hkv)[None, :], (slots % block)[:, None], k, v)
    layer = PagedLayer(settings, 0, hq, hkv, d, d ** -0.5, None, compiled=True)
    planner = Planner(settings)
    planner.begin(["a"])
    if held < length:  # begun again: it keeps the prompt it first had
        planner.held["a"] = held
    plan = planner.for_step(0, ["a"], torch.tensor([0, length - cached], dtype=torch.int32),
                            torch.tensor([length], dtype=torch.int32), table, slots[cached:], block)
    out = torch.empty(length - cached, hq, d, dtype=dtype)
    start = time.perf_counter()
    layer.step(plan, q[cached:], k[cached:], v[cached:], cache, out)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=350)
    ap.add_argument("--cached", type=int, default=256)
    ap.add_argument("--generated", default="100,200", help="recomputed tokens after the held prompt, comma-separated")
    ap.add_argument("--budget", type=int, default=104)
    ap.add_argument("--heads", default="14,2,64", help="query heads, KV heads, head size (Qwen2.5-Coder-0.5B's)")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads = tuple(int(x) for x in args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    settings = parse({"budget": args.budget, "prefill": "keep-prompt"})

    def median_ms(fn) -> float:
        fn()
        return 1e3 * statistics.median(fn() for _ in range(args.repeats))

    rows = [("new request, fused", median_ms(lambda: one_step(settings, heads, args.block, args.prompt,
                                                              args.cached, args.prompt, dtype)))]
    with mock.patch.object(prompt_path, "held_whole", lambda *a, **k: False):
        rows.append(("new request, the core's one-row layer",
                     median_ms(lambda: one_step(settings, heads, args.block, args.prompt, args.cached, args.prompt,
                                                dtype))))
    for gen in (int(x) for x in args.generated.split(",")):
        rows.append((f"begun again, {gen} generated tokens recomputed",
                     median_ms(lambda n=args.prompt + gen: one_step(settings, heads, args.block, n, 0, args.prompt,
                                                                    dtype))))
    print(f"| first chunk ({args.prompt}-token prompt, {args.cached} cached; {args.dtype}, {args.threads} threads) "
          "| ms (median) |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
