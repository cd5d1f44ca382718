"""``scissorhands generate`` and ``scissorhands demo``: one prompt under a budget, beside the full cache if asked,
with what the cache held and the measured cost."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig

from .checks import check_generation_args, check_model_args, check_trust_args
from .parser import cache_settings

NO_BUDGET = 2**31 - 1  # the quantised full cache's budget: no sequence reaches it


def read_prompt(args) -> str:
    from ..text import read_text_file

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


def _chat(system: str | None, tokenizer, prompt: str) -> tuple[str, int | None]:
    """The prompt to run (chat-templated with --system) and the system prompt's tokens (None without one)."""
    if system is None:
        return prompt, None
    from ..generation import chat_prompt

    return chat_prompt(tokenizer, system, prompt)


def _protection(todo: GenerateJob, tokenizer, prompt: str, n_system: int | None) -> tuple[list, dict, str]:
    """The spans to pin, the spans to audit, and the flags the pinned spans came from (for error messages)."""
    spans: list[tuple[int, int]] = []
    watched: dict[str, tuple[int, int]] = {}
    names = []
    if n_system is not None:
        watched["system"] = (0, n_system)
        if todo.protect_system:
            spans.append((0, n_system))
            names.append("protect-system")
    if todo.protect_prefix is not None:
        spans.append((0, todo.protect_prefix))
        names.append("protect-prefix")
    n_prompt = len(tokenizer(prompt)["input_ids"])
    watched = {"prompt": (0, n_prompt), **watched}
    if spans:
        watched["protected"] = (0, max(end for _, end in spans))
    return spans, watched, "/".join(names)


def _write_audit(path: Path, audit, cache, watched: dict) -> None:
    from ..plots import plot_held_map

    png = path.with_suffix(".png")
    plot_held_map(cache, png, spans=watched)
    record = audit.to_json(path, cache)
    parts = []
    for name, info in record["spans"].items():
        held = [v for v in info["held_fraction"].values() if v is not None]
        first = info["first_evicted_step_any_layer"]
        lost = "never evicted" if first is None else f"first evicted at step {first}"
        if held:
            parts.append(f"{name} {info['start']}-{info['end']}: {100 * sum(held) / len(held):.0f}% held "
                         f"(layer min {100 * min(held):.0f}%), {lost}")
    print(f"[audit] {'; '.join(parts)}; wrote {path} and {png}", file=sys.stderr)


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


def _method(name: str):
    try:
        from scissorhands.core.methods import get_method

        return get_method(name)  # validate before the slow model load
    except ValueError as e:  # the registry names its 'methods'; this command's option is --method
        raise ValueError(f"method: {str(e).split(': ', 1)[-1]}") from None


@dataclass(frozen=True)
class GenerateJob:
    """One ``generate`` or ``demo`` run, its flags checked (:func:`job`): what loading, planning, generating and
    reporting read, so that nothing after the checks reads the flags again.

    ``budget`` is as given (a token count, a fraction of the prompt and the new tokens), :data:`NO_BUDGET` for
    the quantised full cache, None with ``memory``; ``config`` is the configuration where the flags alone fix
    it (a token budget), else None: the plan turns a fraction or a memory target into tokens once the prompt's
    length is known (:meth:`plan`)."""

    model: str
    dtype: Any  # as given: a name, or None for the model's own
    device: str
    method: Any
    settings: CacheSettings
    config: ScissorhandsConfig | None
    budget: int | float | None
    memory: str | None
    max_new_tokens: int
    sampling: dict
    system: str | None = None
    protect_system: bool = False
    protect_prefix: int | None = None
    audit: Path | None = None
    audit_events: bool = False
    compare_full: bool = False
    prompt_name: str = "prompt"

    def plan(self, model, length: int, protect=None, protect_name: str = "protect"):
        """The plan the cache is built from: the settings, the method's own, and the budget as given, turned
        into tokens by the plan once (:func:`scissorhands.core.planning.assembly.plan`)."""
        from scissorhands.core.tokens.protect import Protection
        from scissorhands.hf.cache import cache_plan

        return cache_plan(model, self.settings, self.method(seed=self.sampling["seed"]), budget=self.budget,
                          memory=self.memory, length=length, protection=Protection.parse(protect),
                          protect_name=protect_name)

    def budget_label(self, made) -> str:
        """The budget as the run reports it: as given, and the tokens it became where the plan chose them."""
        if self.method.is_full:
            return "none"
        if isinstance(made.config.schedule, tuple):  # an explicit list fixes every layer's budget
            return (f"{','.join(str(b) for b in made.config.schedule)} per layer (an explicit --schedule; "
                    f"--budget {self.budget:g} is not used)")
        if made.memory_choice is not None:  # a byte budget: the store and tokens chosen for this model
            return f"{made.config.budget} tokens, chosen for --memory {self.memory}"
        if self.config is None:  # a fractional budget: of this prompt and the new tokens
            return f"{self.budget:g} ({made.config.budget} tokens)"
        return f"{self.budget}"


def job(args) -> GenerateJob:
    """The run ``generate`` and ``demo`` make of their flags: every flag checked here, before the model loads
    (the cache's settings, the method's own and the budget by the plan's own rules)."""
    check_generation_args(args)
    check_trust_args(args)
    check_model_args(args)
    method = _method(args.method)
    settings = cache_settings(args)
    if method.is_full and not settings.quantized:
        raise ValueError("method: 'full' evicts nothing; use --compare-full to run the full cache beside a method, "
                         "or --kv-bits for a quantised full cache")
    memory = getattr(args, "memory", None)
    budget = args.budget
    if budget is None and memory is None:
        budget = getattr(args, "budget_fallback", None)
    from scissorhands.core.planning.assembly import check_plan

    # Every rule of the plan's that needs no model, checked before the load.
    if method.is_full:  # the quantised full cache: a budget no sequence reaches, so nothing is evicted
        check_plan(settings, method, memory=memory)
        budget = NO_BUDGET
    elif budget is None and memory is None:
        raise ValueError("budget: required: --budget B (tokens or a fraction), or --memory M (a byte budget)")
    else:
        budget = check_plan(settings, method, budget=budget, memory=memory)
    config = method.configure(settings, budget) if isinstance(budget, int) else None
    sampling = dict(do_sample=args.sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                    ignore_eos=args.ignore_eos)
    return GenerateJob(
        model=args.model, dtype=args.dtype, device=args.device, method=method, settings=settings, config=config,
        budget=budget, memory=memory, max_new_tokens=args.max_new_tokens, sampling=sampling, system=args.system,
        protect_system=args.protect_system, protect_prefix=args.protect_prefix, audit=args.audit,
        audit_events=args.audit_events, compare_full=args.compare_full,
        prompt_name="prompt-file" if getattr(args, "prompt_file", None) is not None else "prompt")


def run(args, prompt) -> int:
    """``generate`` or ``demo``: ``prompt`` is the text, or a function of the tokenizer (the demo's)."""
    todo = job(args)
    from ..generation import generate  # imports transformers: after every check
    from ..models import load_model

    model, tokenizer = load_model(todo.model, dtype=todo.dtype, device=todo.device)
    if callable(prompt):  # the demo's prompt needs the tokenizer (its chat template)
        prompt = prompt(tokenizer)
    prompt, n_system = _chat(todo.system, tokenizer, prompt)
    spans, watched, protect_name = _protection(todo, tokenizer, prompt, n_system)
    length = watched["prompt"][1] + todo.max_new_tokens
    made = todo.plan(model, length, spans or None, protect_name)
    if made.memory_choice is not None:
        print(f"[scissorhands] {made.memory_choice.describe()}", file=sys.stderr)
    audit = None
    if todo.audit is not None:
        from scissorhands.core.layer.audit import EvictionAudit

        audit = EvictionAudit(events=todo.audit_events, spans=watched)
    result = generate(model, tokenizer, prompt, made, todo.max_new_tokens, progress=True,
                      prompt_name=todo.prompt_name, audit=audit, protect_name=protect_name, **todo.sampling)
    budget_text = todo.budget_label(made)
    name = todo.method.name
    print(f"prompt: {result.prompt_tokens[0]} tokens; budget {budget_text}", file=sys.stderr)
    if todo.compare_full:
        print(f"--- {name}, budget {budget_text} ---")
    print(result.texts[0])
    _report(name, result)
    if todo.compare_full:
        _compare_full(model, tokenizer, prompt, made, result, todo)
    if audit is not None and todo.audit is not None:
        _write_audit(todo.audit, audit, result.cache, watched)
    return 0


def _compare_full(model, tokenizer, prompt: str, made, result, todo: GenerateJob) -> None:
    """``--compare-full``: the full cache's answer beside the budgeted one, and what the budget cost it."""
    from ..generation import answer_cost, generate

    full = generate(model, tokenizer, prompt, None, todo.max_new_tokens, progress=True, **todo.sampling)
    print(f"\n--- full cache ---\n{full.texts[0]}\n")
    _report("full cache", full)
    a, b = result.new_tokens[0], full.new_tokens[0]
    n = min(len(a), len(b))
    diverge = next((i for i in range(n) if a[i] != b[i]), n)
    print(f"[compare] identical to the full cache for the first {diverge} of {n} new tokens; decode "
          f"speed ratio {result.decode_tokens_per_second / full.decode_tokens_per_second:.2f}x", file=sys.stderr)
    cost = answer_cost(model, tokenizer, prompt, full.new_tokens[0], made)
    for line in compare_lines(result.memory, cost):
        print(line)


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
