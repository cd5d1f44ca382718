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
import ctypes
import gc
import logging
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from transformers import DynamicCache

from scissorhands.core.methods import get_method
from scissorhands.core.planning.memory_target import Shape, store_bytes
from scissorhands.core.settings.config import PREFILL_MODES, CacheSettings, ScissorhandsConfig
from scissorhands.core.stores import STORES, store_name
from scissorhands.core.stores.centers import centers_frame
from scissorhands.hf.cache import ScissorhandsCache
from scissorhands.hf.modelinfo import FULL, model_facts, text_config

from .bench_config import BenchConfig, budget_tokens, parse_size  # noqa: F401  (the bench's public names)

logger = logging.getLogger(__name__)

# -- process memory --------------------------------------------------------------------------------------------

def rss_bytes() -> int | None:
    """The process's resident set now (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """Peak RSS of the process over its life (``getrusage``; kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024


def _reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (``VmHWM``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _release_free_memory() -> None:
    """Return freed heap memory to the OS (glibc), so the next run's RSS growth is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- caches, analytic sizes ------------------------------------------------------------------------------------

def cache_bytes(cache) -> dict:
    """K/V, importance and position bytes of any cache, from tensor storage, every layer counted."""
    if isinstance(cache, ScissorhandsCache):
        rep = cache.memory_report()
        return {"kv_bytes": rep["model_kv_bytes"], "importance_bytes": rep["importance_bytes"],
                "position_bytes": rep["position_bytes"], "full_kv_bytes": rep["model_full_kv_bytes"]}
    kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers
             if getattr(layer, "keys", None) is not None and layer.keys.numel())
    return {"kv_bytes": kv, "importance_bytes": 0, "position_bytes": 0, "full_kv_bytes": kv}


def analytic_bytes(model, cache, batch: int, seen: int) -> dict:
    """What the cache should hold, from the shapes alone.

    A full-attention layer holds ``seen`` tokens in a full cache and its
    budget in a budgeted one; a sliding layer holds ``min(seen, window - 1)``
    (transformers' ``DynamicSlidingWindowLayer``) in both.
    """
    facts = model_facts(model)
    elsize = next(model.parameters()).element_size()
    per_token = 2 * facts.num_kv_heads * facts.head_dim * elsize  # K and V, one layer
    budgets = [layer.budget for layer in getattr(cache, "budgeted_layers", [])]
    config = getattr(cache, "config", None)
    one_layer = Shape(1, facts.num_kv_heads, facts.head_dim, facts.head_dim, elsize)
    kv, importance = 0, 0
    full_idx = 0
    layers = getattr(cache, "budgeted_layers", [])
    for layer_type, window in zip(facts.layer_types, facts.sliding_windows):
        if layer_type == FULL and budgets and config is not None and getattr(config, "kv_demote", None) is not None:
            # A demoting (tiered) store: base planes, pools at their shares, indices, residual.
            kv += batch * store_bytes(replace(config, budget=budgets[full_idx]), one_layer)
            full_idx += 1
            continue
        if layer_type == FULL and budgets:
            # The store's own byte model (KVStore.bytes_for: packed data with its scales, or dense rows); a
            # store that declares none is counted at the model's dtype.
            held = STORES[store_name(config)].bytes_for(config, one_layer, budgets[full_idx])
            kv += batch * (facts.num_kv_heads * held if held is not None else budgets[full_idx] * per_token)
            if config is not None and getattr(config, "kv_key_centers", None) is not None:
                kv += facts.num_kv_heads * facts.head_dim * 4  # one float32 centre per KV head and channel
                if centers_frame(config.kv_key_centers) == "rotary":
                    kv += facts.head_dim // 2 * 4  # and the RoPE frequencies they are turned by
            # A full-precision residual: each row's newest tokens again, in the model's dtype.
            residual = getattr(layers[full_idx].kv.store, "residual", 0)
            kv += batch * min(residual, budgets[full_idx], seen) * per_token
            full_idx += 1
            continue
        tokens = min(seen, window - 1) if window is not None else seen
        kv += batch * tokens * per_token
    for layer in getattr(cache, "budgeted_layers", []):
        importance += batch * facts.num_kv_heads * layer.budget * layer.state.bytes_per_token_head()
    return {"kv_bytes": kv, "importance_bytes": importance}


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
    _release_free_memory()
    if on_cuda:  # the cap is on the accelerator's memory: its allocator's own peak, exact
        torch.cuda.reset_peak_memory_stats(ids.device)
        before, resettable = torch.cuda.memory_allocated(ids.device), True
    else:
        before = rss_bytes()
        resettable = _reset_peak()
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
    hwm = torch.cuda.max_memory_allocated(ids.device) if on_cuda else _hwm_bytes()
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

def tables(result: dict) -> str:
    """Markdown tables of a :func:`run_bench` result."""
    lines: list[str] = []
    if result.get("decode"):
        if result.get("config", {}).get("repeat_rows"):
            lines += ["Rows are one prompt's caches repeated (`--repeat-rows`): \"prefill s\" is that one row's.", ""]
        lines += ["| context | batch | variant | tokens held | step ms (median) | tokens/s | prefill s |",
                  "|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for v in point["variants"]:
                held = v["budget"] if v["budget"] is not None else v["context"]
                lines.append(f"| {point['context']} | {point['batch']} | {v['name']} | {held} | "
                             f"{v['step_s'] * 1e3:.1f} | {v['tokens_per_s']:.1f} | {v['prefill_s']:.2f} |")
        lines += ["", "| context | batch | budget | ours tok/s | full at budget tok/s | vs reference | "
                  "full at context tok/s | vs full |", "|---|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for r in point["ratios"]:
                label = "" if r.get("method", "scissorhands") == "scissorhands" else f"{r['method']} "
                spec = r["fraction"] if isinstance(r["fraction"], str) else f"{r['fraction']:g}"
                lines.append(f"| {point['context']} | {point['batch']} | {label}{spec} ({r['budget']}) | "
                             f"{r['tokens_per_s']:.1f} | {r['reference_tokens_per_s']:.1f} | {r['vs_reference']:.2f} | "
                             f"{r['full_tokens_per_s']:.1f} | {r['vs_full']:.2f} |")
        lines += ["", "| context | batch | variant | KV bytes (storage) | analytic | importance bytes | analytic | "
                  "match |", "|---|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for v in point["variants"]:
                m, a = v["measured"], v["analytic"]
                lines.append(f"| {point['context']} | {point['batch']} | {v['name']} | {m['kv_bytes']:,} | "
                             f"{a['kv_bytes']:,} | {m['importance_bytes']:,} | {a['importance_bytes']:,} | "
                             f"{'yes' if v['bytes_match'] else 'NO'} |")
        lines.append("")
    if result.get("prefill"):
        lines += ["| prompt | variant | prefill s (median) | ratio to SDPA |", "|---|---|---|---|"]
        for r in result["prefill"]:
            lines.append(f"| {r['context']} | {r['variant']} | {r['seconds']:.3f} | {r['ratio_to_sdpa']:.2f} |")
        lines.append("")
    if result.get("maxbatch"):
        lines += ["| variant | budget | max batch | x full | decode tok/s at max batch | x full | used MiB |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["maxbatch"]:
            br = f"{r['batch_ratio']:.2f}" if r["batch_ratio"] is not None else "-"
            tr = f"{r['tokens_per_s_ratio']:.2f}" if r["tokens_per_s_ratio"] is not None else "-"
            tps = f"{r['tokens_per_s_at_max']:.1f}" if r["tokens_per_s_at_max"] else "-"
            used = f"{r['used_bytes_at_max'] / 2**20:.1f}" if r["used_bytes_at_max"] is not None else "-"
            more = " (limit)" if r["hit_limit"] else ""
            lines.append(f"| {r['variant']} | {r['budget'] or '-'} | {r['max_batch']}{more} | {br} | {tps} | {tr} | "
                         f"{used} |")
        lines.append("")
    if result.get("soak"):
        s = result["soak"]
        lines.append(f"soak: {s['tokens']} tokens at budget {s['budget']}: cache bytes flat after fill: {s['flat']}; "
                     f"RSS growth after fill {s.get('rss_growth_after_fill', float('nan')):+.2%}; "
                     f"tokens/s last/first {s.get('speed_window_tokens', 0)} tokens "
                     f"{s.get('speed_last_over_first', float('nan')):.3f}")
    if "peak_rss_bytes" in result:
        lines.append(f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB")
    if result.get("interrupted"):
        lines.append("interrupted: only the points above were measured")
    return "\n".join(lines)


def plot(result: dict, out_dir) -> list[str]:
    """PNG plots: throughput against context, memory against tokens generated, max batch against budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    if result.get("decode"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for batch in sorted({p["batch"] for p in result["decode"]}):
            points = [p for p in result["decode"] if p["batch"] == batch]
            names = [v["name"] for v in points[0]["variants"] if "reference_for" not in v]
            drawn: set = set()  # one reference line per budget, however many methods share it
            for name in names:
                xs = [p["context"] for p in points]
                ys = [next(v["tokens_per_s"] for v in p["variants"] if v["name"] == name) for p in points]
                line, = ax.plot(xs, ys, marker="o", label=f"{name}, batch {batch}")
                fraction = next((v.get("fraction") for v in points[0]["variants"] if v["name"] == name), None)
                refs = [(p["context"], v["tokens_per_s"]) for p in points for v in p["variants"]
                        if fraction is not None and v.get("reference_for") == fraction]
                if refs and fraction not in drawn:  # the reference point: the full cache at context = budget
                    drawn.add(fraction)
                    ax.plot([x for x, _ in refs], [y for _, y in refs], marker="s", ls=":", color=line.get_color(),
                            alpha=0.7, label=f"full cache at the budget of {name}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("Decode throughput against context")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput.png", dpi=120)
        plt.close(fig)
        written.append("throughput.png")
    if result.get("soak"):
        s = result["soak"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["tokens"] for r in s["records"]]
        ax.plot(xs, [r["cache_bytes"] / 2**20 for r in s["records"]], marker=".", label="cache (K/V + state), MiB")
        if all(r["rss_bytes"] is not None for r in s["records"]):
            ax.plot(xs, [r["rss_bytes"] / 2**20 for r in s["records"]], marker=".", label="process RSS, MiB")
        ax.set_xlabel("tokens generated")
        ax.set_ylabel("MiB")
        ax.set_title(f"Memory over a long generation (budget {s['budget']})")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["tokens_per_s"] for r in s["records"]], color="gray", linestyle="--", label="tokens/s")
        ax2.set_ylabel("tokens/s")
        ax.legend(loc="center left", fontsize=7)
        ax2.legend(loc="center right", fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "memory.png", dpi=120)
        plt.close(fig)
        written.append("memory.png")
    if result.get("maxbatch"):
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = result["maxbatch"]
        ax.bar([r["variant"] for r in rows], [r["max_batch"] for r in rows])
        ax.set_ylabel("largest batch under the cap")
        ax.set_title(f"Max batch under {result['config']['cap_memory'] / 2**20:.0f} MiB")
        fig.tight_layout()
        fig.savefig(out_dir / "max_batch.png", dpi=120)
        plt.close(fig)
        written.append("max_batch.png")
    return written
