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
from dataclasses import replace

import torch
from transformers import DynamicCache

from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import PREFILL_MODES, CacheSettings, ScissorhandsConfig
from scissorhands.hf.cache import ScissorhandsCache
from scissorhands.hf.modelinfo import model_facts, text_config

from .bench_config import BenchConfig, budget_tokens, parse_size  # noqa: F401  (the bench's public names)
from .bench_memory import (
    analytic_bytes,
    cache_bytes,
    hwm_bytes,
    peak_rss_bytes,
    release_free_memory,
    reset_peak,
    rss_bytes,
)

logger = logging.getLogger(__name__)

# -- process memory --------------------------------------------------------------------------------------------



CHUNKED = "prompt-aware, chunked"  # the prefill part's name for prompt-aware with the settings' prompt_chunk


def _make_cache(model, budget: int | None, settings: CacheSettings, prefill: str | None = None,
                method: str = "scissorhands", chosen: dict | None = None):
    if budget is None:
        return DynamicCache(config=model.config)
    config = settings.with_budget(budget) if chosen is None else ScissorhandsConfig(budget=budget, **chosen)
    if prefill is not None:  # a mode named by the prefill part: the held prompt-aware prefill unless chunked
        chunked = prefill == CHUNKED
        config = replace(config.with_plugin("prefill", "prompt-aware" if chunked else prefill),
                         prompt_chunk=config.prompt_chunk if chunked else None)
    return ScissorhandsCache(model, config, get_method(method)())


def _tokens(model, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids (B, length): seeded, away from the special ids at the start of the vocabulary."""
    vocab = text_config(model).vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(16, vocab - 1), vocab, (batch, length), generator=gen).to(model.device)


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward over ``ids`` through ``cache``; the next token per row (greedy).

    On an accelerator it waits for the queued work, so that wall-clock timings cover it.
    """
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
    if nxt.device.type == "cuda":
        torch.cuda.synchronize(nxt.device)
    return nxt


def _prefill(model, ids: torch.Tensor, cache, chunk: int | None) -> torch.Tensor:
    step = ids.shape[1] if chunk is None else chunk
    nxt = None
    for start in range(0, ids.shape[1], step):
        nxt = _forward(model, ids[:, start:start + step], cache)
    assert nxt is not None
    return nxt


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
        from scissorhands.hf.cache import choose_memory

        label, first = f"memory={memory}", None
        for m in methods:
            choice = choose_memory(model, settings or CacheSettings(), get_method(m)(), memory, context)
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
                s["next"] = _forward(model, s["next"], s["cache"])
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
        ids = _tokens(model, batch, v["context"] - lead, cfg.seed + i)
        cache = _make_cache(model, v["budget"], cfg.settings, method=v.get("method", "scissorhands"),
                            chosen=v.get("chosen"))
        start = time.perf_counter()
        with torch.no_grad():
            nxt = _prefill(model, ids, cache, cfg.prefill_chunk)
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
            for prefill in PREFILL_MODES:
                variants.append((f"scissorhands {f:g}, {prefill}", budget_tokens(f, context), prefill))
            if cfg.settings.prompt_chunk is not None:
                variants.append((f"scissorhands {f:g}, prompt-aware, chunk {cfg.settings.prompt_chunk}",
                                 budget_tokens(f, context), CHUNKED))
        ids = _tokens(model, 1, context, cfg.seed)
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        with torch.no_grad():
            for rep in range(cfg.repeats + 1):  # the first round is the warm-up
                for name, budget, mode in variants:
                    cache = _make_cache(model, budget, cfg.settings, mode, cfg.methods[0])
                    start = time.perf_counter()
                    _prefill(model, ids, cache, None)
                    if rep:
                        times[name].append(time.perf_counter() - start)
                    del cache
        base = statistics.median(times["full (SDPA)"])
        for name, budget, mode in variants:
            med = statistics.median(times[name])
            out.append({"context": context, "variant": name, "budget": budget, "prefill": mode, "seconds": med,
                        "seconds_all": times[name], "ratio_to_sdpa": med / base})
    return out


# -- max batch under a memory cap ------------------------------------------------------------------------------

def max_fitting(fits: Callable[[int], bool], limit: int) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch in [1, limit] for which ``fits`` holds, assuming it is monotone (fits(b) implies fits(b-1)).

    Doubles from 1 until a batch does not fit (or the limit), then bisects.
    Returns the batch (0 if even 1 does not fit) and the trials in order.
    """
    trials: list[tuple[int, bool]] = []

    def check(b: int) -> bool:
        ok = fits(b)
        trials.append((b, ok))
        return ok

    good, bad = 0, None
    b = 1
    while b <= limit:
        if check(b):
            good = b
            b *= 2
        else:
            bad = b
            break
    if bad is None:
        if good < limit and check(limit):
            return limit, trials
        bad = limit if good < limit else limit + 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if check(mid):
            good = mid
        else:
            bad = mid
    return good, trials


def generation_trial(model, make_cache: Callable[[], object], batch: int, prompt: int, new: int, chunk: int,
                     seed: int = 0) -> dict:
    """Run one generation (chunked prefill, then ``new`` greedy steps) and measure what it cost.

    Returns
    -------
    dict
        ``rss_growth_bytes`` (peak RSS during the run minus RSS before it, None
        where the kernel does not let the peak be reset; for a model on a CUDA
        device, the device's peak allocated memory minus what was allocated
        before), ``cache_bytes`` (K/V
        + importance + positions from tensor storage, the larger of after the
        prefill and at the end), ``decode_tokens_per_s`` (aggregate over the
        batch), ``seconds``.
    """
    ids = _tokens(model, batch, prompt, seed)
    on_cuda = ids.device.type == "cuda"
    before: int | None
    release_free_memory()
    if on_cuda:  # the cap is on the accelerator's memory: its allocator's own peak, exact
        torch.cuda.reset_peak_memory_stats(ids.device)
        before, resettable = torch.cuda.memory_allocated(ids.device), True
    else:
        before = rss_bytes()
        resettable = reset_peak()
    cache = make_cache()
    start = time.perf_counter()
    with torch.no_grad():
        nxt = _prefill(model, ids, cache, chunk)
        after_prefill = sum(cache_bytes(cache)[k] for k in ("kv_bytes", "importance_bytes", "position_bytes"))
        mid = time.perf_counter()
        for _ in range(new - 1):
            nxt = _forward(model, nxt, cache)
    end = time.perf_counter()
    held = sum(cache_bytes(cache)[k] for k in ("kv_bytes", "importance_bytes", "position_bytes"))
    hwm = torch.cuda.max_memory_allocated(ids.device) if on_cuda else hwm_bytes()
    growth = None if not resettable or hwm is None or before is None else max(0, hwm - before)
    del cache
    return {"batch": batch, "rss_growth_bytes": growth, "cache_bytes": max(after_prefill, held),
            "decode_tokens_per_s": batch * (new - 1) / (end - mid) if new > 1 else float("nan"),
            "seconds": end - start}


def maxbatch_part(model, cfg: BenchConfig, trial: Callable[..., dict] = generation_trial) -> list[dict]:
    """Largest batch that fits the cap, full cache and each budget (a fraction of prompt + new tokens)."""
    assert cfg.cap_memory is not None
    total = cfg.cap_prompt + cfg.cap_new
    variants: list[tuple[str, str, int | None]] = [("full", "full", None)]
    variants += [(f"{m} {f:g}", m, budget_tokens(f, total)) for f in cfg.budgets for m in cfg.methods]
    out: list[dict] = []
    # One discarded run first: the process's first generation pays one-time allocations (thread pools,
    # allocator arenas) that would otherwise count against whichever variant runs first.
    trial(model, lambda: _make_cache(model, None, cfg.settings), 1, cfg.cap_prompt, cfg.cap_new, cfg.prefill_chunk,
          cfg.seed)
    for name, method, budget in variants:
        runs: dict[int, dict] = {}

        def fits(b: int, budget=budget, runs=runs, method=method) -> bool:
            r = trial(model, lambda: _make_cache(model, budget, cfg.settings, method=method), b, cfg.cap_prompt,
                      cfg.cap_new, cfg.prefill_chunk, cfg.seed)
            used = r["rss_growth_bytes"] if cfg.fit == "rss" and r["rss_growth_bytes"] is not None else r["cache_bytes"]
            r["used_bytes"] = used
            runs[b] = r
            return used <= cfg.cap_memory

        best, trials = max_fitting(fits, cfg.cap_limit)
        at = runs.get(best, {})
        out.append({"variant": name, "budget": budget, "max_batch": best, "trials": [runs[b] for b, _ in trials],
                    "tokens_per_s_at_max": at.get("decode_tokens_per_s"), "used_bytes_at_max": at.get("used_bytes"),
                    "hit_limit": best == cfg.cap_limit})
    full = out[0]
    for row in out:
        row["batch_ratio"] = row["max_batch"] / full["max_batch"] if full["max_batch"] else None
        t, ft = row["tokens_per_s_at_max"], full["tokens_per_s_at_max"]
        row["tokens_per_s_ratio"] = t / ft if t and ft else None
    return out


# -- soak ------------------------------------------------------------------------------------------------------

def soak_part(model, cfg: BenchConfig) -> dict:
    """Generate ``soak_tokens`` tokens at ``soak_budget``; every ``soak_every`` steps record bytes, RSS and speed.

    ``flat`` is True when the cache's bytes at the end equal its bytes at the
    first record after the cache filled (seen > budget).
    """
    cache = _make_cache(model, cfg.soak_budget, cfg.settings, method=cfg.methods[0])
    ids = _tokens(model, 1, cfg.soak_prompt, cfg.seed)
    records: list[dict] = []
    with torch.no_grad():
        nxt = _prefill(model, ids, cache, cfg.prefill_chunk)
        seen = cfg.soak_prompt
        mark = time.perf_counter()
        for step in range(1, cfg.soak_tokens + 1):
            nxt = _forward(model, nxt, cache)
            seen += 1
            if step % cfg.soak_every == 0 or step == cfg.soak_tokens:
                now = time.perf_counter()
                b = cache_bytes(cache)
                n = step - (records[-1]["tokens"] if records else 0)
                records.append({"tokens": step, "seen": seen,
                                "cache_bytes": b["kv_bytes"] + b["importance_bytes"] + b["position_bytes"],
                                "kv_bytes": b["kv_bytes"], "rss_bytes": rss_bytes(), "tokens_per_s": n / (now - mark)})
                mark = time.perf_counter()
    filled = [r for r in records if r["seen"] > cfg.soak_budget]
    out: dict = {"budget": cfg.soak_budget, "tokens": cfg.soak_tokens, "every": cfg.soak_every, "records": records,
           "flat": bool(filled) and filled[0]["cache_bytes"] == records[-1]["cache_bytes"]}
    if len(filled) >= 2:
        rss = [r["rss_bytes"] for r in filled if r["rss_bytes"] is not None]
        if rss:
            out["rss_growth_after_fill"] = (rss[-1] - rss[0]) / rss[0]
        # Tokens/s over the last 2,000 tokens against the first 2,000 after warm-up (the first full interval
        # after the fill is the warm-up); windows shrink to half the steady records on shorter runs.
        steady = filled[1:] if len(filled) > 2 else filled
        k = max(1, min(2000 // cfg.soak_every, len(steady) // 2))
        out["speed_window_tokens"] = k * cfg.soak_every
        out["speed_last_over_first"] = _rate(steady[-k:], cfg.soak_every) / _rate(steady[:k], cfg.soak_every)
    return out


def _rate(records: list[dict], every: int) -> float:
    """Tokens/s over consecutive records of ``every`` tokens each: total tokens over total time."""
    return len(records) * every / sum(every / r["tokens_per_s"] for r in records)


# -- the whole run ---------------------------------------------------------------------------------------------

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
