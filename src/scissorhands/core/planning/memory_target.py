"""A memory budget in bytes: choose the store (bits, key bits, residual) and the token budget for the user.

``memory`` is either a fraction of the full cache's K/V bytes (in the model's
dtype, for the sequence at hand, over the budgeted layers), or an absolute size
per sequence: an integer number of bytes, or text such as ``"64MiB"``.

The rule, from measurements. For each store of the measured frontier
(``data/frontier.json``, built by ``experiments/frontier_data.py`` from the
eviction × bits grid in docs/appendix/results_log.md), it takes the largest token budget
whose peak bytes fit the target, counting everything stored: the K/V elements
(packed or not), their scales and zero-points, the full-precision residual,
the importance state and the positions. It then reads the store's measured
ΔNLL at that budget, interpolating in the log of the budget fraction, and
keeps the store with the smallest. A target no store can meet is a one-line
``ValueError`` naming ``memory`` and the smallest reachable size.

The default frontier was measured on SmolLM2-135M; a model family with a
frontier of its own (``data/frontier_<model_type>.json``: Qwen2, measured on
Qwen2.5-Coder-0.5B) uses that one, because stores do not rank alike across
families: Qwen2.5's keys carry large per-channel offsets that 4-bit per-token
groups cannot hold (docs/results.md, "Larger models"), unless they are quantised
around rotary key centres; that store is a curve of its own (``"key_centers":
"rotary"``), a candidate only when the settings bring a rotary centre file. On
any other model the choice assumes the stores rank as on SmolLM2. The bytes are
exact for the model at hand.

Demotion before eviction (``kv_demote``) is one of the stores: 8-bit for the
recent window and a little more, 4-bit below it, measured in float32
(docs/appendix/results_log.md, "Demotion before eviction"). It wins where there are bytes
to spare beyond a 4-bit cache of the whole sequence, and ties the 4-bit store
below that.

The peak is between chunks. While a chunk is taken, a packed store's exact tail
also holds that chunk's newest block: at most one block of full-precision
tokens more, and none during decoding.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from ..settings.config import CacheSettings, ScissorhandsConfig
from ..settings.tiers import tier_caps

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class Family:
    """One store of the frontier and its measured ΔNLL against the token budget (a fraction of the sequence)."""

    name: str
    label: str
    kv_bits: int | None
    kv_key_bits: int | None
    kv_residual: int | None
    points: tuple[tuple[float, float], ...]
    kv_demote: tuple[tuple[int, float], ...] | None = None
    #: ``"rotary"``: measured with rotary key centres (``scissorhands calibrate``), so a candidate only when the
    #: settings bring such a file (``kv_key_centers``).
    key_centers: str | None = None

    def predicted(self, fraction: float) -> tuple[float, bool]:
        """ΔNLL at ``fraction``, interpolated in log(fraction), and whether it lies outside the measured range."""
        pts = self.points
        fraction = min(fraction, 1.0)
        tol = 1e-4  # the curves store fractions to six digits: a budget measured exactly is not "outside"
        if fraction >= pts[-1][0]:
            return pts[-1][1], fraction > pts[-1][0] * (1 + tol)
        if fraction <= pts[0][0]:
            (f0, d0), (f1, d1) = pts[0], pts[1]
            outside = fraction < f0 * (1 - tol)
        else:
            i = next(i for i in range(1, len(pts)) if pts[i][0] >= fraction)
            (f0, d0), (f1, d1) = pts[i - 1], pts[i]
            outside = False
        t = (math.log(fraction) - math.log(f0)) / (math.log(f1) - math.log(f0))
        return d0 + t * (d1 - d0), outside


def frontier_file(model_type: str | None = None) -> str:
    """The shipped frontier for a model family: ``data/frontier_<model_type>.json`` if there is one, else the
    default ``data/frontier.json`` (measured on SmolLM2-135M)."""
    data = resources.files("scissorhands.core").joinpath("data")
    if model_type and data.joinpath(f"frontier_{model_type}.json").is_file():
        return f"data/frontier_{model_type}.json"
    return "data/frontier.json"


def frontier_model(model_type: str | None = None) -> str:
    """The model the frontier for ``model_type`` was measured on."""
    record = json.loads(resources.files("scissorhands.core").joinpath(frontier_file(model_type)).read_text())
    return record.get("measured_on", "SmolLM2-135M")


def load_frontier(model_type: str | None = None) -> list[Family]:
    """The shipped frontier for a model family (:func:`frontier_file`)."""
    record = json.loads(resources.files("scissorhands.core").joinpath(frontier_file(model_type)).read_text())
    return [Family(f["name"], f["label"], f["kv_bits"], f["kv_key_bits"], f["kv_residual"],
                   tuple((float(a), float(b)) for a, b in f["points"]),
                   None if not f.get("kv_demote") else tuple((int(b), float(x)) for b, x in f["kv_demote"]),
                   f.get("key_centers"))
            for f in record["families"]]


def parse_memory(spec) -> float | int:
    """``0.2`` (a fraction in (0, 1]) or a size in bytes (an int, or text with a unit: ``"64MiB"``, ``"1.5GB"``).

    Raises a one-line ``ValueError`` naming ``memory``.
    """
    if isinstance(spec, str):
        text = spec.strip().lower().replace(" ", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmg]i?b|b)?", text)
        if not m:
            raise ValueError(f"memory: must be a fraction of the full cache (0.2) or a size (64MiB, 2GB), got {spec!r}")
        number, unit = float(m.group(1)), m.group(2) or ""
        if not unit and ("." in m.group(1) or "e" in m.group(1)):
            spec = number
        elif not unit:  # "1" could mean the whole cache or one byte: a size needs its unit
            raise ValueError(f"memory: a size needs a unit (4096B, 64MiB, 2GB); a fraction is written 0.2 or 1.0, "
                             f"got {spec!r}")
        else:
            size = number * _UNITS[unit]
            if not math.isfinite(size) or size < 1:
                raise ValueError(f"memory: a size must be at least 1 byte, got {spec!r}")
            return int(size)
    if isinstance(spec, bool) or not isinstance(spec, numbers.Real) or not math.isfinite(spec):
        raise ValueError(f"memory: must be a fraction of the full cache or a size in bytes, got {spec!r}")
    if isinstance(spec, numbers.Integral):
        if spec < 1:
            raise ValueError(f"memory: a size in bytes must be >= 1, got {spec}")
        return int(spec)
    value = float(spec)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"memory: a fraction of the full cache must be in (0, 1], got {spec}")
    return value


@dataclass(frozen=True)
class Shape:
    """What the bytes depend on: the budgeted layers, KV heads, head sizes and the model's element size."""

    layers: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int
    itemsize: int
    #: transformers' ``model_type`` (``"qwen2"``, ``"llama"``): which measured frontier applies.
    model_type: str | None = None


@dataclass(frozen=True)
class MemoryChoice:
    """What ``memory=`` chose, and the numbers behind the choice."""

    memory: float | int
    config: ScissorhandsConfig
    family: str
    target_bytes: int
    peak_bytes: int
    full_bytes: int
    predicted_delta_nll: float
    extrapolated: bool
    measured_on: str = "SmolLM2-135M"
    #: Key centres were given, and the chosen store does not use them (a 16-bit store, or a rotary file beside a
    #: store measured without one).
    centres_unused: bool = False

    def describe(self) -> str:
        """One line for the CLI and the reports."""
        c = self.config
        bits = "16-bit" if not c.quantized else (f"{c.kv_bits}-bit" if c.kv_key_bits is None else
                                                 f"{c.kv_key_bits}-bit keys / {c.kv_bits}-bit values")
        if c.kv_demote:
            chain = ", ".join(f"{b}-bit for {share:g} of the budget" for b, share in c.kv_demote)
            bits = f"{chain}, then {c.kv_bits}-bit (demotion before eviction)"
        residual = f", residual {c.kv_residual}" if c.quantized and c.kv_residual else ""
        if c.kv_key_centers is not None:
            residual += ", keys around the given centres"
        elif self.centres_unused:
            residual += " (the key centres given are not used by this store)"
        guess = "extrapolated" if self.extrapolated else f"measured on {self.measured_on}"
        return (f"memory {self.memory}: {bits}{residual}, budget {c.budget} tokens; peak {self.peak_bytes:,} of "
                f"{self.target_bytes:,} bytes ({self.full_bytes / self.peak_bytes:.1f}x less than the full cache's "
                f"{self.full_bytes:,}); expected ΔNLL about {self.predicted_delta_nll:+.3f} ({guess})")

    def record(self) -> dict:
        return {"memory": self.memory, "family": self.family, "budget": self.config.budget,
                "kv_bits": self.config.kv_bits, "kv_key_bits": self.config.kv_key_bits,
                "kv_demote": self.config.kv_demote,
                "kv_residual": self.config.kv_residual, "kv_key_centers": self.config.kv_key_centers,
                "target_bytes": self.target_bytes,
                "peak_bytes": self.peak_bytes, "full_bytes": self.full_bytes,
                "predicted_delta_nll": self.predicted_delta_nll, "extrapolated": self.extrapolated,
                "measured_on": self.measured_on}


def held_tokens(config: ScissorhandsConfig) -> int:
    """The most slots a layer holds at once: the budget, plus one chunk while a chunked prompt-aware prefill
    holds it beside the budget (an unchunked one holds the whole prompt: :func:`check_memory_settings`)."""
    if config.prefill == "prompt-aware" and config.prompt_chunk is not None:
        return config.budget + config.prompt_chunk
    return config.budget


def peak_bytes(config: ScissorhandsConfig, shape: Shape, evicts: bool = True) -> int:
    """Peak bytes a sequence holds over the budgeted layers under ``config`` (between chunks).

    The K/V store (:func:`store_bytes`), the importance state and an int32 position per slot, over the slots
    a layer holds at its peak (:func:`held_tokens`): the slots grow up to that whatever the sequence's
    length, so the settings alone decide.
    """
    state_item = max(shape.itemsize, 4) if config.importance != "count" else 2
    per_token = config.n_buckets() * state_item + 4  # importance state, an int32 position
    return store_bytes(config, shape, evicts) + shape.layers * shape.kv_heads * held_tokens(config) * per_token


def store_bytes(config: ScissorhandsConfig, shape: Shape, evicts: bool = True) -> int:
    """Peak bytes of the K/V store alone, by the store's own byte model (``KVStore.bytes_for``: elements, packed
    or not, scales and zero-points, a tiered store's pools and indices), plus the full-precision residual."""
    from ..stores import STORES, store_name  # torch: imported on use

    name = store_name(config)
    per_head = STORES[name].bytes_for(config, shape, held_tokens(config))
    if per_head is None:
        raise ValueError(f"kv_store: the store {name!r} declares no byte model (KVStore.bytes_for), so a memory "
                         "target cannot be planned for it")
    dense = (shape.head_dim_k + shape.head_dim_v) * shape.itemsize
    residual = min(config.residual_for(config.budget, evicts), config.budget) * dense  # 0 for a lossless store
    return shape.layers * (shape.kv_heads * (per_head + residual) + centre_bytes(config, shape))


def centre_bytes(config: CacheSettings, shape: Shape) -> int:
    """One layer's key centres (float32 per KV head and channel, and the RoPE frequencies that turn rotary
    ones): 0 without centres or packed K/V."""
    if config.kv_key_centers is None or not config.quantized:
        return 0
    rotary = _frame(config.kv_key_centers) == "rotary"
    return shape.kv_heads * shape.head_dim_k * 4 + (shape.head_dim_k // 2 * 4 if rotary else 0)


def check_memory_settings(settings) -> None:
    """Refuse, in one line naming both, a setting that ``memory=`` would otherwise override in silence.

    A memory target chooses the store (``kv_bits``, ``kv_key_bits``, ``kv_residual``, ``kv_demote``, hence
    ``kv_store``) and the token budget; a per-layer list of budgets (``schedule``) fixes every layer's budget
    instead. Given with ``memory``, either would run something other than what was chosen.
    """
    if not isinstance(settings, CacheSettings):
        raise ValueError(f"settings: must be a CacheSettings, got {type(settings).__name__}")
    for name in ("kv_bits", "kv_key_bits", "kv_residual", "kv_demote", "kv_store"):
        if getattr(settings, name) is not None:
            raise ValueError(f"memory: chooses the store itself; give memory or {name}, not both (got "
                             f"{name}={getattr(settings, name)!r})")
    if isinstance(settings.schedule, tuple):
        raise ValueError("memory: chooses the token budget itself; give memory or a per-layer schedule list, "
                         "not both (use schedule='uniform' or 'increasing')")
    if settings.prefill == "keep-prompt":
        raise ValueError("memory: a keep-prompt prefill keeps each prompt beside the budget, so its peak grows with "
                         "the prompt; give a token budget, or use prefill='prompt-aware' with prompt_chunk")
    if settings.prefill == "prompt-aware" and settings.prompt_chunk is None:
        raise ValueError("memory: a prompt-aware prefill holds the whole prompt at once, whatever the budget; give "
                         "prompt_chunk as well (its peak is then the budget plus one chunk, which memory= counts)")


def choose(memory, shape: Shape, length: int, base: CacheSettings,
           frontier: list[Family] | None = None) -> MemoryChoice:
    """The store and token budget whose peak bytes fit ``memory`` best, by the measured frontier.

    ``base`` keeps every setting but the store's (``kv_bits``, ``kv_key_bits``, ``kv_residual``,
    ``kv_demote``), which the choice sets.
    """
    spec = parse_memory(memory)
    full = length * shape.layers * shape.kv_heads * (shape.head_dim_k + shape.head_dim_v) * shape.itemsize
    target = int(spec * full) if isinstance(spec, float) else spec
    best: MemoryChoice | None = None
    smallest = None
    measured_on = frontier_model(shape.model_type)
    rotary = base.kv_key_centers is not None and _frame(base.kv_key_centers) == "rotary"
    for family in frontier or load_frontier(shape.model_type):
        if family.key_centers == "rotary" and (not rotary or base.merge):
            continue  # measured with rotary key centres, and the settings bring none (or merge, which refuses them)
        if rotary and family.kv_demote is not None:
            continue  # the tiered store takes fixed centres only
        try:
            store: dict[str, Any] = {
                "kv_bits": family.kv_bits, "kv_key_bits": family.kv_key_bits, "kv_demote": family.kv_demote,
                "kv_residual": family.kv_residual if family.kv_bits else None,
                "kv_key_centers": _centres_for(family, base.kv_key_centers, rotary)}
            settings = replace(base, **store)  # the packed stores' own settings among them, by name
        except ValueError:  # a store these settings cannot take (demotion with a prompt-aware prefill)
            continue
        floor = _floor(settings, length)
        if floor is None:
            continue
        fits = _largest_budget(settings, shape, length, target, floor)
        at_floor = peak_bytes(ScissorhandsConfig(budget=floor, **settings.as_dict()), shape)
        smallest = at_floor if smallest is None else min(smallest, at_floor)
        if fits is None:
            continue
        config = ScissorhandsConfig(budget=fits, **settings.as_dict())
        delta, outside = family.predicted(fits / length)
        choice = MemoryChoice(spec, config, family.name, target, peak_bytes(config, shape), full, delta,
                              outside, measured_on)
        if best is None or (delta, choice.peak_bytes) < (best.predicted_delta_nll, best.peak_bytes):
            best = choice
    if smallest is None:
        raise ValueError("memory: no store of the measured frontier can be built with these settings (for example "
                         "a tiered store with rotary kv_key_centers, or demotion with a prompt-aware prefill)")
    if best is None:
        raise ValueError(f"memory: {memory!r} ({target:,} bytes) cannot be met for {length} tokens: the smallest "
                         f"reachable peak is {smallest:,} bytes ({(smallest or 0) / full:.4f} of the full cache's "
                         f"{full:,})")
    if base.kv_key_centers is not None and best.config.kv_key_centers is None:
        best = replace(best, centres_unused=True)
    return best


def _centres_for(family: Family, centres: str | None, rotary: bool) -> str | None:
    """The key centres a family's store gets: a rotary file only for the store measured with it (elsewhere its
    per-token positions would cost bytes the measurement did not pay), a fixed file for any packed store."""
    if not family.kv_bits:
        return None
    if rotary:
        return centres if family.key_centers == "rotary" else None
    return centres


def _frame(path: str) -> str:
    """The frame of a key-centre file (:func:`~scissorhands.core.stores.centers.centers_frame`)."""
    from ..stores.centers import centers_frame  # torch: only when centres are given

    return centers_frame(path)


def _valid(settings: CacheSettings, budget: int) -> bool:
    """Whether a cache can be built at this budget (the residual must fit the recent window, and so on)."""
    try:
        config = ScissorhandsConfig(budget=budget, **settings.as_dict())
        config.check_residual(budget)
        if config.kv_demote is not None:
            tier_caps(config.kv_demote, budget, config.recent_for(budget), config.drop_for(budget))
    except ValueError:
        return False
    return True


def _floor(settings: CacheSettings, length: int) -> int | None:
    """The smallest budget these settings can be built at (a residual needs a recent window as large)."""
    budget = settings.protected + 1
    while budget <= max(length, settings.protected + 1):
        if _valid(settings, budget):
            return budget
        budget += 1
    return None


def _largest_budget(settings: CacheSettings, shape: Shape, length: int, target: int, floor: int) -> int | None:
    """The largest token budget in [floor, length] whose peak fits ``target`` (bytes grow with the budget)."""
    def peak(b):
        if not _valid(settings, b):
            return None
        return peak_bytes(ScissorhandsConfig(budget=b, **settings.as_dict()), shape)

    lo, hi = floor, max(floor, length)
    first = peak(lo)
    if first is None or first > target:
        return None
    while lo < hi:  # invariant: peak(lo) fits
        mid = (lo + hi + 1) // 2
        p = peak(mid)
        if p is not None and p <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo
