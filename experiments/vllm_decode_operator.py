"""Micro-benchmarks of the vLLM adapter's compiled operators, without an engine (the project's own environment).

* ``decode``: the decode operator (:func:`scissorhands.vllm.kernels.decode`, output and importance) over R
  requests whose windows of B tokens lie in vLLM's CPU blocks of 128, for float32 K/V ("vec" layout) and bf16 in
  the "vec" and "amx" layouts, against the operator built from an earlier revision's source (``--before REV``),
  alternated before/after, ``--repeats`` times each; medians of the per-call times.
* ``rounds``: the torch operators one step's rounds dispatch over L layers (R requests, ``--rounding`` of them
  rounding), through the compiled rounds operator and through the torch rounds it replaced
  (``rounds.move_victims_reference``), counted with a dispatch mode; the compiled call itself is one more.

    python experiments/vllm_decode_operator.py decode --before 1acff08 --heads 3,9 --out OUT.json
    python experiments/vllm_decode_operator.py rounds --layers 30 --requests 32
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scissorhands.vllm import build, kernels
from scissorhands.vllm.paged import PagedLayer
from scissorhands.vllm.rounds import move_victims_reference, round_layers
from scissorhands.vllm.settings import parse

BLOCK, HEAD = 128, 64  # vLLM's CPU block size; the head size of SmolLM2-135M and Qwen2.5-0.5B
ROOT = Path(__file__).resolve().parents[1]


def operator_at(rev: str):
    """The operator built from revision ``rev``'s C++ (the source string of its kernels.py, or its csrc files)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout

    text = show("src/scissorhands/vllm/kernels.py")
    found = re.search(r'_SOURCE = r"""(.*?)"""', text, re.S)
    if found:
        source, flags = found.group(1), []
    else:  # the C++ in files: built here with the current header folder's name
        raise SystemExit(f"--before {rev}: its kernels.py has no inline source; give a revision before csrc/")
    name = f"scissorhands_paged_at_{rev[:12]}"
    return build.load(name, source, ["decode"], [*kernels._CFLAGS, *flags], ["-lmvec"])


def decode_args(requests: int, budget: int, hkv: int, hq: int, dtype, layout: str, gen: torch.Generator):
    """A cache whose requests' windows end at positions past the budget, spread over the blocks."""
    per = -(-(budget + 3 * BLOCK) // BLOCK)
    nb = requests * per
    cache = torch.randn(nb, hkv, BLOCK, 2 * HEAD, generator=gen).to(dtype)
    tables = torch.randperm(nb, generator=gen).view(requests, per).to(torch.int32)
    last = torch.randint(budget, per * BLOCK - 1, (requests,), generator=gen)
    query = torch.randn(requests, hq, HEAD, generator=gen)
    tok = torch.arange(requests)
    bucket = torch.zeros(requests, dtype=torch.long)
    restart = torch.zeros(requests, dtype=torch.bool)
    acc = torch.zeros(1, nb, hkv, BLOCK)
    out = torch.empty(requests, hq, HEAD)
    return (query, cache, tok, last, tables, bucket, restart, acc, out, budget, HEAD ** -0.5, 0.0, False, True,
            True, kernels.LAYOUTS[layout], 0, 1.0, 1.0)


def time_calls(fn, args, calls: int) -> float:
    """Median seconds of ``calls`` calls after a few warm-up ones."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_decode(opts) -> dict:
    torch.set_num_threads(opts.threads)
    before, after = operator_at(opts.before), kernels.build()
    gen = torch.Generator().manual_seed(0)
    hkv, hq = (int(x) for x in opts.heads.split(","))
    cases = [("float32 vec", torch.float32, "vec"), ("bf16 vec", torch.bfloat16, "vec"),
             ("bf16 amx", torch.bfloat16, "amx")]
    rows = {}
    for label, dtype, layout in cases:
        args = decode_args(opts.requests, opts.budget, hkv, hq, dtype, layout, gen)
        got = {"before": [], "after": []}
        for _ in range(opts.repeats):  # alternated: before, after, after, before, ...
            for which in (("before", "after") if len(got["before"]) % 2 == 0 else ("after", "before")):
                op = before if which == "before" else after
                got[which].append(time_calls(op.decode, args, opts.calls))
        med = {k: statistics.median(v) * 1e3 for k, v in got.items()}
        rows[label] = {"before_ms": med["before"], "after_ms": med["after"], "speedup": med["before"] / med["after"],
                       "runs_ms": {k: [x * 1e3 for x in v] for k, v in got.items()}}
        print(f"{label:12s} before {med['before']:.3f} ms  after {med['after']:.3f} ms  "
              f"{med['before'] / med['after']:.2f}x", flush=True)
    return {"requests": opts.requests, "budget": opts.budget, "heads": [hkv, hq], "head_size": HEAD,
            "block": BLOCK, "threads": opts.threads, "before": opts.before, "rows": rows}


class Count(TorchDispatchMode):
    """Counts the torch operators dispatched."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def run_rounds(opts) -> dict:
    gen = torch.Generator().manual_seed(0)
    settings = parse({"budget": opts.budget})
    per = -(-(opts.budget + BLOCK) // BLOCK) + 1
    nb = opts.requests * per
    hkv = int(opts.heads.split(",")[0])
    counts = {}
    for compiled in (True, False):
        layers = [PagedLayer(settings, i, hkv * 3, hkv, HEAD, HEAD ** -0.5, None, compiled=compiled)
                  for i in range(opts.layers)]
        caches = [torch.randn(nb, hkv, BLOCK, 2 * HEAD, generator=gen) for _ in layers]
        pos = torch.stack([torch.randperm(nb * BLOCK * hkv, generator=gen).view(nb * BLOCK, hkv)
                           for _ in layers]).int()
        acc = torch.rand(opts.layers, 1, nb, hkv, BLOCK, generator=gen)
        for i, layer in enumerate(layers):
            layer.pos, layer.acc, layer.kv_cache, layer.block = pos[i], acc[i], caches[i], BLOCK
        tables = torch.randperm(nb, generator=gen)[:opts.rounding * per].view(opts.rounding, per)
        seen = torch.randint(opts.budget, (per - 1) * BLOCK, (opts.rounding,), generator=gen)
        positions = seen[:, None] - opts.budget + torch.arange(opts.budget)[None, :]
        window = tables.gather(1, positions // BLOCK) * BLOCK + positions % BLOCK
        with Count() as mode:
            round_layers(layers, pos, acc, caches, window, seen, BLOCK)
        counts["compiled" if compiled else "torch"] = mode.n
    print(f"torch operators of one step's rounds over {opts.layers} layers, {opts.rounding} rows rounding: "
          f"torch path {counts['torch']}, compiled {counts['compiled']} + 1 call", flush=True)
    assert move_victims_reference is not None
    return {"layers": opts.layers, "rounding": opts.rounding, "budget": opts.budget, "ops": counts}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("decode", "rounds"))
    ap.add_argument("--before", default="1acff08", help="the revision whose operator is 'before' (decode)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", type=int, default=210)
    ap.add_argument("--heads", default="3,9", help="KV heads,query heads")
    ap.add_argument("--repeats", type=int, default=6, help="alternated runs of each operator (decode)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per run (decode)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30, help="layers (rounds)")
    ap.add_argument("--rounding", type=int, default=4, help="requests rounding in the step (rounds)")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args(argv)
    result = run_decode(opts) if opts.what == "decode" else run_rounds(opts)
    result["command"] = "python experiments/vllm_decode_operator.py " + " ".join(argv or __import__("sys").argv[1:])
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
