"""What ``scissorhands bench`` measures of memory: the process's resident and peak memory (reset between parts
where the system allows), a cache's K/V and state bytes from its tensors, and their analytic size."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import resource

from scissorhands.core.planning.memory_target import Shape
from scissorhands.hf.cache import ScissorhandsCache
from scissorhands.hf.modelinfo import FULL, model_facts

from .bench_config import BenchConfig, budget_tokens, parse_size  # noqa: F401  (the bench's public names)

logger = logging.getLogger(__name__)


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


def reset_peak() -> bool:
    """Reset the kernel's RSS high-water mark (``VmHWM``); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def release_free_memory() -> None:
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
    one_layer = Shape(1, facts.num_kv_heads, facts.head_dim, facts.head_dim, elsize)
    kv, importance = 0, 0
    full_idx = 0
    for layer_type, window in zip(facts.layer_types, facts.sliding_windows):
        if layer_type == FULL and budgets:
            # The plan's byte model: the store's own (packed data with its scales, a tiered store's pools and
            # indices, or dense rows), each row's full-precision residual, and the layer's key centres once.
            kv += cache.plan.layer_kv_bytes(full_idx, one_layer, rows=batch)
            full_idx += 1
            continue
        tokens = min(seen, window - 1) if window is not None else seen
        kv += batch * tokens * per_token
    for layer in getattr(cache, "budgeted_layers", []):
        importance += batch * facts.num_kv_heads * layer.budget * layer.state.bytes_per_token_head()
    return {"kv_bytes": kv, "importance_bytes": importance}
