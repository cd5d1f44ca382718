"""``scissorhands bench``: options, checks and output files; the measuring is :mod:`scissorhands.tools.bench`.

Options are parsed by argparse with typed converters and their defaults are
:class:`~.bench_config.BenchConfig`'s; the config checks the values (a
``ValueError`` whose message starts with the option's name), all before the
model is loaded.
"""

from __future__ import annotations

import functools
import json
import sys

from .bench_config import BenchConfig, parse_size
from .cliargs import NAMES, NUMBERS, WHOLE, WHOLES, add_cache_args, add_model_args, alias, arg_type
from .cliargs import option as add_option

_OUTPUT_FILES = ("bench.json", "tables.md", "throughput.png", "memory.png", "max_batch.png")


def add_parser(subparsers):
    """Add the ``bench`` subcommand: typed options whose defaults are :class:`~.bench_config.BenchConfig`'s."""
    d = BenchConfig
    p = subparsers.add_parser("bench", allow_abbrev=False,
                              help="decode and prefill speed against context and batch, memory, max batch under a "
                              "cap, and a soak run")
    add_model_args(p)
    add_cache_args(p, with_budget=False)
    g = p.add_argument_group("bench")
    opt = functools.partial(add_option, g)

    opt("--seq-len", WHOLES, d.contexts, "decode: comma list of context lengths T", dest="seq_len")
    alias(g, "--contexts", "--seq-len", "seq_len")
    opt("--batches", WHOLES, d.batches, "decode: comma list of batch sizes")
    opt("--methods", NAMES, d.methods, "comma list of evicting methods to measure beside the full cache, as in "
        "eval (decode and max batch; prefill and soak use the first)")
    opt("--budgets", NUMBERS, d.budgets, "comma list of budgets: fractions (< 1) of each context, or token counts "
        "(> 1), as in eval")
    opt("--steps", WHOLE, d.steps, "decode: timed steps per variant (median reported)")
    opt("--warmup", WHOLE, d.warmup, "decode: untimed steps per variant first")
    opt("--prefill-chunk", WHOLE, d.prefill_chunk, "prompt chunk when building the decode and max-batch caches")
    g.add_argument("--repeat-rows", action="store_true",
                   help="decode: prefill one prompt per variant and context and repeat its caches for every batch "
                   "size (a step costs the same; a long context's prefill is paid once)")
    opt("--prefill-seq-len", WHOLES, d.prefill_contexts, "prefill: comma list of prompt lengths")
    alias(g, "--prefill-contexts", "--prefill-seq-len", "prefill_seq_len")
    opt("--repeats", WHOLE, d.repeats, "prefill: interleaved repeats (median reported)")
    opt("--cap-memory", arg_type(parse_size), d.cap_memory, "max batch: memory cap, e.g. 2GiB or 512MiB")
    g.add_argument("--memory", default=None, metavar="M,M",
                   help="decode: comma list of memory budgets (fractions of the full cache's bytes, or sizes such "
                   "as 64MiB), each a variant whose store and token budget are chosen for it (see generate --memory)")
    opt("--fit", str, d.fit, "max batch: 'rss' (peak RSS growth of the run <= cap) or 'cache' (cache tensor bytes "
        "<= cap)")
    opt("--cap-prompt", WHOLE, d.cap_prompt, "max batch: prompt tokens")
    opt("--cap-new", WHOLE, d.cap_new, "max batch: new tokens generated")
    opt("--cap-limit", WHOLE, d.cap_limit, "max batch: the largest batch tried")
    opt("--soak-tokens", WHOLE, d.soak_tokens, "soak: tokens generated at --soak-budget (0: no soak)")
    opt("--soak-budget", WHOLE, d.soak_budget, "soak: token budget per layer")
    opt("--soak-every", WHOLE, d.soak_every, "soak: record memory and speed every this many tokens")
    opt("--soak-prompt", WHOLE, d.soak_prompt, "soak: prompt tokens")
    g.add_argument("--parts", type=NAMES, default=None,
                   help="comma list of decode, prefill, maxbatch, soak (default: decode and prefill, plus maxbatch "
                   "with --memory and soak with --soak-tokens)")
    opt("--threads", WHOLE, 0, "torch threads (0: leave as is)")
    opt("--seed", WHOLE, d.seed, "seed of the random prompts")
    g.add_argument("--out", default="bench-out", help="output folder: bench.json, tables.md and PNG plots")
    g.add_argument("--replace", action="store_true",
                   help="--out may hold an earlier bench run: remove its files first (refused otherwise)")
    return p


def config_from_args(args, settings):
    """A validated :class:`~.bench_config.BenchConfig` from the parsed options (``ValueError`` naming one)."""
    parts = args.parts
    if parts is None:
        parts = (("decode", "prefill") + ("maxbatch",) * (args.cap_memory is not None)
                 + ("soak",) * (args.soak_tokens > 0))
    if "soak" in parts and args.soak_tokens <= 0:
        raise ValueError("soak-tokens: the soak part needs --soak-tokens >= 1")
    if args.threads < 0:
        raise ValueError(f"threads: must be >= 0, got {args.threads}")
    if len(set(args.methods)) != len(args.methods):
        raise ValueError(f"methods: a method is listed twice in {','.join(args.methods)}")
    from scissorhands.core.methods import get_method

    for name in args.methods:
        get_method(name)  # one line naming methods for an unknown one
    return BenchConfig(
        contexts=args.seq_len, batches=args.batches, budgets=args.budgets, steps=args.steps, warmup=args.warmup,
        prefill_chunk=args.prefill_chunk, prefill_contexts=args.prefill_seq_len, repeats=args.repeats,
        memories=_memories(args.memory), cap_memory=args.cap_memory, fit=args.fit, cap_prompt=args.cap_prompt,
        cap_new=args.cap_new,
        cap_limit=args.cap_limit, soak_tokens=args.soak_tokens, soak_budget=args.soak_budget,
        soak_every=args.soak_every, soak_prompt=args.soak_prompt, parts=tuple(parts), settings=settings,
        seed=args.seed, methods=args.methods, repeat_rows=args.repeat_rows,
    ), args.threads


def _memories(text: str | None) -> tuple:
    """``--memory``: each spec checked now (a one-line error naming ``memory``)."""
    if text is None:
        return ()
    from scissorhands.core.planning.memory_target import parse_memory

    specs = tuple(parse_memory(m.strip()) for m in text.split(",") if m.strip())
    if not specs:
        raise ValueError("memory: is empty")
    return specs


def run(args, settings, check_model_args) -> int:
    """Run ``scissorhands bench``: check everything, load the model, measure, write JSON, tables and plots.

    The output folder may not hold an earlier run's ``bench.json`` unless
    ``--replace`` is given, which removes every file an earlier run wrote
    (so no plot of a part this run skips is left beside its results). On
    Ctrl-C, the parts and points finished so far are written, marked
    ``"interrupted": true``, before the interrupt goes on.
    """
    import torch

    from .bench import run_bench
    from .bench_report import plot, tables
    from .models import load_model, resolve_dtype
    from .paths import check_apart, check_output_folder

    if settings.head_budgets is not None:  # its analytic bytes (bench_memory.analytic_bytes) hold one budget per layer
        raise ValueError("head_budgets: not measured by bench, whose bytes from shapes hold one budget for every "
                         "head; measure it with eval (kv_held) or the memory report")
    cfg, threads = config_from_args(args, settings)
    check_model_args(args)
    out = check_output_folder(args.out, "out", _OUTPUT_FILES)
    check_apart({"out": [out / f for f in _OUTPUT_FILES]},
                {"schedule": settings.schedule if isinstance(settings.schedule, str) else None,
                 "kv-key-centers": settings.kv_key_centers})
    if (out / "bench.json").exists() and not args.replace:
        raise ValueError(f"out: {str(out)!r} holds an earlier bench run (bench.json); give another folder, or "
                         "--replace to replace that run")
    if threads:
        torch.set_num_threads(threads)
    model, _ = load_model(args.model, dtype=resolve_dtype(args.dtype), device=args.device)
    result: dict = {}
    try:
        run_bench(model, cfg, progress=lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True),
                  result=result)
    except KeyboardInterrupt:
        if any(result.get(part) for part in ("decode", "prefill", "maxbatch", "soak")):
            result["interrupted"] = True
            result["model_name"] = args.model
            _write(result, out, tables, plot, args.replace)
            print(f"bench: interrupted; the measurements finished so far are in {out / 'bench.json'}",
                  file=sys.stderr, flush=True)
        raise
    result["model_name"] = args.model
    print(_write(result, out, tables, plot, args.replace))
    return 0


def _write(result: dict, out, tables, plot, replace: bool) -> str:
    """Write bench.json, tables.md and the plots (removing an earlier run's files first with ``replace``)."""
    out.mkdir(parents=True, exist_ok=True)
    if replace:
        for name in _OUTPUT_FILES:
            if (out / name).is_file():
                (out / name).unlink()
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    text = tables(result)
    (out / "tables.md").write_text(text + "\n")
    plot(result, out)
    return text
