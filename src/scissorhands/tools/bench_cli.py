"""``scissorhands bench``: options, checks and output files; the measuring is :mod:`scissorhands.tools.bench`.

Options are parsed as text and checked in :func:`config_from_args`, so a bad
value is a ``ValueError`` whose message starts with the option's name, raised
before the model is loaded.
"""

from __future__ import annotations

import json
import math
import sys

from .cliargs import alias

_OUTPUT_FILES = ("bench.json", "tables.md", "throughput.png", "memory.png", "max_batch.png")


def add_parser(subparsers, add_model_args, add_cache_args):
    """Add the ``bench`` subcommand; the model and cache options come from the main CLI's helpers."""
    p = subparsers.add_parser("bench", allow_abbrev=False,
                              help="decode and prefill speed against context and batch, memory, max batch under a "
                              "cap, and a soak run")
    add_model_args(p)
    add_cache_args(p, with_budget=False)
    g = p.add_argument_group("bench")
    g.add_argument("--seq-len", default="1024,2048,4096,8192", help="decode: comma list of context lengths T")
    alias(g, "--contexts", "--seq-len", "seq_len")
    g.add_argument("--batches", default="1,8", help="decode: comma list of batch sizes")
    g.add_argument("--methods", default="scissorhands",
                   help="comma list of evicting methods to measure beside the full cache, as in eval (decode and "
                   "max batch; prefill and soak use the first)")
    g.add_argument("--budgets", default="0.5,0.2,0.1",
                   help="comma list of budgets: fractions (< 1) of each context, or token counts (> 1), as in eval")
    g.add_argument("--steps", default="16", help="decode: timed steps per variant (median reported)")
    g.add_argument("--warmup", default="2", help="decode: untimed steps per variant first")
    g.add_argument("--prefill-chunk", default="512", help="prompt chunk when building the decode and max-batch caches")
    g.add_argument("--prefill-seq-len", default="2048,8192", help="prefill: comma list of prompt lengths")
    alias(g, "--prefill-contexts", "--prefill-seq-len", "prefill_seq_len")
    g.add_argument("--repeats", default="3", help="prefill: interleaved repeats (median reported)")
    g.add_argument("--memory", default=None, help="max batch: memory cap, e.g. 2GiB or 512MiB")
    g.add_argument("--fit", default="rss",
                   help="max batch: 'rss' (peak RSS growth of the run <= cap) or 'cache' (cache tensor bytes <= cap)")
    g.add_argument("--cap-prompt", default="1024", help="max batch: prompt tokens")
    g.add_argument("--cap-new", default="64", help="max batch: new tokens generated")
    g.add_argument("--cap-limit", default="512", help="max batch: the largest batch tried")
    g.add_argument("--soak-tokens", default="0", help="soak: tokens generated at --soak-budget (0: no soak)")
    g.add_argument("--soak-budget", default="256", help="soak: token budget per layer")
    g.add_argument("--soak-every", default="256", help="soak: record memory and speed every this many tokens")
    g.add_argument("--soak-prompt", default="128", help="soak: prompt tokens")
    g.add_argument("--parts", default=None,
                   help="comma list of decode, prefill, maxbatch, soak (default: decode and prefill, plus maxbatch "
                   "with --memory and soak with --soak-tokens)")
    g.add_argument("--threads", default="0", help="torch threads (0: leave as is)")
    g.add_argument("--seed", default="0")
    g.add_argument("--out", default="bench-out", help="output folder: bench.json, tables.md and PNG plots")
    return p


def _int(text: str, name: str) -> int:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}: expected a whole number, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name}: expected a whole number, got {text!r}")
    return int(value)


def _list(text: str, name: str, kind) -> tuple:
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name}: is empty")
    if kind is int:
        return tuple(_int(x, name) for x in items)
    try:
        values = tuple(float(x) for x in items)
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None
    return values


def _methods(text: str) -> tuple[str, ...]:
    from scissorhands.core.methods import get_method

    names = tuple(x.strip() for x in str(text).split(",") if x.strip())
    if len(set(names)) != len(names):
        raise ValueError(f"methods: a method is listed twice in {text!r}")
    for name in names:
        get_method(name)  # one line naming methods for an unknown one
    return names


def config_from_args(args, settings):
    """A validated :class:`~.bench.BenchConfig` from the parsed options (``ValueError`` naming one)."""
    from .bench import BenchConfig, parse_size

    memory = None if args.memory is None else parse_size(args.memory, "memory")
    soak = _int(args.soak_tokens, "soak-tokens")
    if args.parts is None:
        parts = ["decode", "prefill"] + ["maxbatch"] * (memory is not None) + ["soak"] * (soak > 0)
    else:
        parts = [x.strip() for x in str(args.parts).split(",") if x.strip()]
    if "soak" in parts and soak <= 0:
        raise ValueError("soak-tokens: the soak part needs --soak-tokens >= 1")
    threads = _int(args.threads, "threads")
    if threads < 0:
        raise ValueError(f"threads: must be >= 0, got {threads}")
    return BenchConfig(
        contexts=_list(args.seq_len, "seq-len", int),
        batches=_list(args.batches, "batches", int),
        budgets=_list(args.budgets, "budgets", float),
        steps=_int(args.steps, "steps"),
        warmup=_int(args.warmup, "warmup"),
        prefill_chunk=_int(args.prefill_chunk, "prefill-chunk"),
        prefill_contexts=_list(args.prefill_seq_len, "prefill-seq-len", int),
        repeats=_int(args.repeats, "repeats"),
        memory=memory,
        fit=str(args.fit),
        cap_prompt=_int(args.cap_prompt, "cap-prompt"),
        cap_new=_int(args.cap_new, "cap-new"),
        cap_limit=_int(args.cap_limit, "cap-limit"),
        soak_tokens=soak,
        soak_budget=_int(args.soak_budget, "soak-budget"),
        soak_every=_int(args.soak_every, "soak-every"),
        soak_prompt=_int(args.soak_prompt, "soak-prompt"),
        parts=tuple(parts),
        settings=settings,
        seed=_int(args.seed, "seed"),
        methods=_methods(args.methods),
    ), threads


def run(args, settings, check_model_args) -> int:
    """Run ``scissorhands bench``: check everything, load the model, measure, write JSON, tables and plots."""
    import torch

    from .bench import plot, run_bench, tables
    from .models import load_model, resolve_dtype
    from .paths import check_output_folder

    cfg, threads = config_from_args(args, settings)
    check_model_args(args)
    out = check_output_folder(args.out, "out", _OUTPUT_FILES)
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(args.model, dtype=resolve_dtype(args.dtype), device=args.device)
    result = run_bench(model, cfg, progress=lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True))
    result["model_name"] = args.model
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    text = tables(result)
    (out / "tables.md").write_text(text + "\n")
    plot(result, out)
    print(text)
    return 0
