"""Memory and throughput at scale: the library behind ``scissorhands bench``.

One run measures, after a warm-up and with the variants interleaved step by
step (so drift on a shared machine hits all of them alike):

* **decode**: per-step latency and tokens/s against context length and batch,
  for the full cache (``DynamicCache``) at context T, ``ScissorhandsCache`` at
  budgets B = f·T, and the *reference point*, the full cache at context B
  (a cache holding B tokens does the same attention work per step);
* **prefill**: time to prefill long prompts, full cache (SDPA) against the
  streamed prefill with no eviction, the streamed prefill at each budget and
  the prompt-aware prefill;
* **memory**: K/V and importance bytes from tensor storage against their
  analytic size, every layer counted, and the process's peak RSS;
* **max batch** under a memory cap, found by running the generation;
* **soak**: cache bytes, RSS and tokens/s every k steps of a long generation.

"Context T" is the number of tokens the cache has seen when the last timed
step runs: the prompt is T minus the warm-up and timed steps, so a full cache
attends over T - steps .. T tokens while it is timed.

Everything returns plain dicts (written as JSON by the CLI); nothing prints.
"""

from __future__ import annotations

import copy
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import PREFILL_MODES, CacheSettings
from scissorhands.hf.modelinfo import model_facts

from .bench_capacity import maxbatch_part, soak_part
from .bench_config import BenchConfig, budget_tokens, parse_size  # noqa: F401  (the bench's public names)
from .bench_memory import (
    analytic_bytes,
    cache_bytes,
    peak_rss_bytes,
)
from .bench_steps import CHUNKED, forward, make_cache, prefill, tokens

logger = logging.getLogger(__name__)

# -- process memory --------------------------------------------------------------------------------------------





# -- decode ----------------------------------------------------------------------------------------------------

def _variants(context: int, budgets, methods=("scissorhands",), memories=(), model=None,
              settings: CacheSettings | None = None) -> list[dict]:
    out = [{"name": "full", "cache": "full", "context": context, "budget": None}]
    for f in budgets:
        b = budget_tokens(f, context)
        for m in methods:
            out.append({"name": f"{m} {f:g}", "cache": "scissorhands", "method": m, "context": context, "budget": b,
                        "fraction": f})
        out.append({"name": f"full at {b}", "cache": "full", "context": b, "budget": None, "reference_for": f})
    for memory in memories:  # memory=: the store and token budget chosen for this context
        from scissorhands.hf.cache import cache_plan

        label, first = f"memory={memory}", None
        for m in methods:
            choice = cache_plan(model, settings or CacheSettings(), get_method(m)(), memory=memory,
                                length=context).memory_choice
            assert choice is not None  # a memory target's plan holds what it chose
            first = choice.config.budget if first is None else first
            out.append({"name": f"{m} {label}", "cache": "scissorhands", "method": m, "context": context,
                        "budget": choice.config.budget, "fraction": label,
                        "chosen": choice.config.settings.as_dict(), "memory_choice": choice.record()})
        out.append({"name": f"full at {first}", "cache": "full", "context": first, "budget": None,
                    "reference_for": label})
    return out


def decode_point(model, cfg: BenchConfig, context: int, batch: int,
                 prefilled: tuple[list[dict], list[dict]] | None = None) -> dict:
    """All variants of one (context, batch) point, prefilled, then timed step by step in turn.

    ``prefilled`` (from :func:`prefill_variants` at batch 1) gives the rows one prompt's caches, copied and
    repeated ``batch`` times, instead of prefilling ``batch`` prompts (``BenchConfig.repeat_rows``).

    Returns
    -------
    dict
        ``context``, ``batch``, ``variants`` (per variant: median step seconds,
        tokens/s, prefill seconds, memory from storage and analytic), and
        ``ratios``: per budget, ``vs_reference`` (our tokens/s over the full
        cache's at context = budget) and ``vs_full`` (over the full cache's at T).
    """
    if prefilled is None:
        variants, states = prefill_variants(model, cfg, context, batch)
    else:
        variants, states = _repeated(prefilled, batch)
    lead = cfg.steps + cfg.warmup
    with torch.no_grad():
        for step in range(lead):
            order = range(len(states)) if step % 2 == 0 else reversed(range(len(states)))
            for i in order:
                s = states[i]
                start = time.perf_counter()
                s["next"] = forward(model, s["next"], s["cache"])
                if step >= cfg.warmup:
                    s["times"].append(time.perf_counter() - start)
    rows = []
    for v, s in zip(variants, states):
        median = statistics.median(s["times"])
        seen = v["context"]  # prompt + lead tokens fed
        row = dict(v, step_s=median, step_s_all=s["times"], tokens_per_s=batch / median, prefill_s=s["prefill_s"],
                   prefill_rows=s["prefill_rows"], measured=cache_bytes(s["cache"]),
                   analytic=analytic_bytes(model, s["cache"], batch, seen))
        row["bytes_match"] = (row["measured"]["kv_bytes"] == row["analytic"]["kv_bytes"]
                              and row["measured"]["importance_bytes"] == row["analytic"]["importance_bytes"])
        rows.append(row)
    del states
    return {"context": context, "batch": batch, "variants": rows, "ratios": reference_ratios(rows)}


def prefill_variants(model, cfg: BenchConfig, context: int, batch: int) -> tuple[list[dict], list[dict]]:
    """The decode point's variants and, per variant, a cache prefilled with ``batch`` seeded prompts."""
    lead = cfg.steps + cfg.warmup
    variants = _variants(context, cfg.budgets, cfg.methods, cfg.memories, model, cfg.settings)
    states = []
    for i, v in enumerate(variants):
        ids = tokens(model, batch, v["context"] - lead, cfg.seed + i)
        cache = make_cache(model, v["budget"], cfg.settings, method=v.get("method", "scissorhands"),
                            chosen=v.get("chosen"))
        start = time.perf_counter()
        with torch.no_grad():
            nxt = prefill(model, ids, cache, cfg.prefill_chunk)
        states.append({"cache": cache, "next": nxt, "prefill_s": time.perf_counter() - start, "times": [],
                       "prefill_rows": batch})
    return variants, states


def _repeated(prefilled: tuple[list[dict], list[dict]], batch: int) -> tuple[list[dict], list[dict]]:
    """Copies of batch-1 prefilled states whose one row is repeated ``batch`` times.

    A decode step's cost depends on the shapes it reads, not on what the rows hold, so the copies time as
    ``batch`` distinct prompts would: every row is full, and evicts, at the same steps either way.
    """
    variants, states = prefilled
    out = []
    for s in states:
        if s["next"].shape[0] != 1:
            raise ValueError("repeat-rows: the prefilled states must hold one row")
        cache = copy.deepcopy(s["cache"])
        cache.batch_repeat_interleave(batch)
        out.append(dict(s, cache=cache, next=s["next"].repeat_interleave(batch, dim=0), times=[]))
    return variants, out


def reference_ratios(rows: list[dict]) -> list[dict]:
    """Per budget: our tokens/s over the full cache's at context = budget, and over the full cache's at T."""
    full = next(r for r in rows if r["cache"] == "full" and "reference_for" not in r)
    out = []
    for r in rows:
        if r["cache"] != "scissorhands":
            continue
        ref = next(x for x in rows if x.get("reference_for") == r["fraction"])
        out.append({"method": r.get("method", "scissorhands"), "fraction": r["fraction"], "budget": r["budget"],
                    "tokens_per_s": r["tokens_per_s"],
                    "reference_tokens_per_s": ref["tokens_per_s"], "full_tokens_per_s": full["tokens_per_s"],
                    "vs_reference": r["tokens_per_s"] / ref["tokens_per_s"],
                    "vs_full": r["tokens_per_s"] / full["tokens_per_s"]})
    return out


# -- prefill ---------------------------------------------------------------------------------------------------

def prefill_part(model, cfg: BenchConfig) -> list[dict]:
    """Prefill seconds (batch 1, one forward of the whole prompt), variants interleaved, medians and ratios to SDPA."""
    out = []
    for context in cfg.prefill_contexts:
        variants: list[tuple[str, int | None, str | None]] = [("full (SDPA)", None, None),
                                                               ("scissorhands, no eviction", context + 1, "stream")]
        for f in cfg.budgets:
            for each in PREFILL_MODES:
                variants.append((f"scissorhands {f:g}, {each}", budget_tokens(f, context), each))
            if cfg.settings.prompt_chunk is not None:
                variants.append((f"scissorhands {f:g}, prompt-aware, chunk {cfg.settings.prompt_chunk}",
                                 budget_tokens(f, context), CHUNKED))
        ids = tokens(model, 1, context, cfg.seed)
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        with torch.no_grad():
            for rep in range(cfg.repeats + 1):  # the first round is the warm-up
                for name, budget, mode in variants:
                    cache = make_cache(model, budget, cfg.settings, mode, cfg.methods[0])
                    start = time.perf_counter()
                    prefill(model, ids, cache, None)
                    if rep:
                        times[name].append(time.perf_counter() - start)
                    del cache
        base = statistics.median(times["full (SDPA)"])
        for name, budget, mode in variants:
            med = statistics.median(times[name])
            out.append({"context": context, "variant": name, "budget": budget, "prefill": mode, "seconds": med,
                        "seconds_all": times[name], "ratio_to_sdpa": med / base})
    return out


def machine() -> dict:
    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}


def run_bench(model, cfg: BenchConfig, progress: Callable[[str], None] | None = None,
              result: dict | None = None) -> dict:
    """Run the parts ``cfg.parts`` asks for; a JSON-ready dict with the config and the machine beside the results.

    ``result``, if given, is filled in place as each point finishes, so a caller
    that is interrupted still holds what was measured.
    """
    say = progress or (lambda _msg: None)
    facts = model_facts(model)
    limit = facts.max_positions
    if isinstance(limit, int) and limit > 0:
        lengths = [(0, "seq-len")]
        lengths += [(t, "seq-len") for t in cfg.contexts] if "decode" in cfg.parts else []
        lengths += [(t, "prefill-seq-len") for t in cfg.prefill_contexts] if "prefill" in cfg.parts else []
        lengths += [(cfg.cap_prompt + cfg.cap_new, "cap-prompt")] if "maxbatch" in cfg.parts else []
        longest, option = max(lengths)
        if longest > limit:
            raise ValueError(f"{option}: {longest} tokens exceed the model's {limit} positions")
    result = {} if result is None else result
    result.update({"config": cfg.record(), "machine": machine(), "model": facts.model_type,
                   "dtype": str(next(model.parameters()).dtype), "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    if "decode" in cfg.parts:
        result["decode"] = []
        for context in cfg.contexts:
            prefilled = None
            if cfg.repeat_rows:  # one prompt per variant and context, its caches repeated for every batch size
                say(f"decode: context {context}, one prompt per variant")
                prefilled = prefill_variants(model, cfg, context, 1)
            for batch in cfg.batches:
                say(f"decode: context {context}, batch {batch}")
                result["decode"].append(decode_point(model, cfg, context, batch, prefilled))
            del prefilled
    if "prefill" in cfg.parts:
        say("prefill")
        result["prefill"] = prefill_part(model, cfg)
    if "maxbatch" in cfg.parts:
        say("max batch")
        result["maxbatch"] = maxbatch_part(model, cfg)
    if "soak" in cfg.parts and cfg.soak_tokens:
        say("soak")
        result["soak"] = soak_part(model, cfg)
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


# -- tables and plots ------------------------------------------------------------------------------------------
