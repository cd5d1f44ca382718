"""How many sequences fit, and whether a long generation holds: the bench's max-batch and soak parts.

The max batch under a memory cap is found by running the generation (:func:`generation_trial`) at growing and
then bisected batch sizes (:func:`max_fitting`); the soak records cache bytes, RSS and tokens/s every k steps of
one long generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .bench_config import BenchConfig, budget_tokens
from .bench_memory import cache_bytes, hwm_bytes, release_free_memory, reset_peak, rss_bytes
from .bench_steps import forward, make_cache, prefill, tokens

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
    ids = tokens(model, batch, prompt, seed)
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
        nxt = prefill(model, ids, cache, chunk)
        after_prefill = sum(cache_bytes(cache)[k] for k in ("kv_bytes", "importance_bytes", "position_bytes"))
        mid = time.perf_counter()
        for _ in range(new - 1):
            nxt = forward(model, nxt, cache)
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
    trial(model, lambda: make_cache(model, None, cfg.settings), 1, cfg.cap_prompt, cfg.cap_new, cfg.prefill_chunk,
          cfg.seed)
    for name, method, budget in variants:
        runs: dict[int, dict] = {}

        def fits(b: int, budget=budget, runs=runs, method=method) -> bool:
            r = trial(model, lambda: make_cache(model, budget, cfg.settings, method=method), b, cfg.cap_prompt,
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
    cache = make_cache(model, cfg.soak_budget, cfg.settings, method=cfg.methods[0])
    ids = tokens(model, 1, cfg.soak_prompt, cfg.seed)
    records: list[dict] = []
    with torch.no_grad():
        nxt = prefill(model, ids, cache, cfg.prefill_chunk)
        seen = cfg.soak_prompt
        mark = time.perf_counter()
        for step in range(1, cfg.soak_tokens + 1):
            nxt = forward(model, nxt, cache)
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
