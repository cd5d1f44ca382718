"""Frozen, validated configuration for budgeted KV eviction.

:class:`CacheSettings` holds everything but the budget: what callers that
resolve a budget per sequence (the evaluation grid, the lm-eval backend, the
analysis) carry around. :class:`ScissorhandsConfig` adds the budget. Each
field is declared once (:func:`~.declare.setting`): its default, its help,
how it is parsed from text and how it is checked. The CLI flags, the lm-eval
and vLLM arguments and docs/usage.md's settings table are derived from those declarations.
Every bad value raises ``ValueError`` whose message starts with the parameter's
name, so the entry points print it as one line.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from . import declare as s
from .declare import REQUIRED, declared, setting, settings_table
from .tiers import check_tiers, parse_tiers

IMPORTANCE_FORMS = ("sum", "count", "mean")
SCHEDULES = ("uniform", "increasing")
PREFILL_MODES = ("stream", "prompt-aware")  # the shipped modes; any registered one is taken (core/attend/prefill.py)
DECODE_MODES = ("dynamic", "static", "compiled")  # the shipped modes; any registered one is taken (layer/decode.py)
KV_BITS = (2, 4, 8, 16)
STORE_NAMES = ("dense", "packed", "tiered")  # the shipped stores; any registered one is taken (core/stores)

DEFAULT_RESIDUAL = 32
"""Tokens of full-precision residual a packed cache keeps by default (``kv_residual=None``).

Measured on SmolLM2-135M (docs/quantization.md, docs/results.md): 4-bit K/V
cost +0.040 nats/token without it and +0.003 with the newest 32 tokens exact;
128 tokens brought nothing more."""


def check_int(name: str, value, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an integer >= ``low``."""
    s.integer(low)(name, value)


def _schedule(name, value):
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, tuple):
        for b in value:
            check_int(name, b, 1)
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a name, a list of budgets or a JSON path, got {value!r}")
    if value not in SCHEDULES and not value.endswith(".json"):
        raise ValueError(f"{name}: must be one of {SCHEDULES}, a list of budgets or a .json file, got {value!r}")
    return value


def _path(name, value):
    return s.optional_path(name, os.fspath(value) if isinstance(value, os.PathLike) else value)


def _odd(name, value):
    value = s.integer(1)(name, value)
    if value % 2 == 0:
        raise ValueError(f"{name}: must be odd (the pooled slot sits in the middle), got {value}")
    return value


def _store_name(name, value):
    if value is None:
        return value
    # As for prefill and decode modes: a store registers by importing core/stores, so the registry is read where
    # it already is; before that only the shipped stores exist (importing it here would import torch).
    stores = sys.modules.get("scissorhands.core.stores")
    names = tuple(getattr(stores, "STORES", STORE_NAMES))
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{name}: must be a registered store ({', '.join(names)}) or None, got {value!r}")
    return value


def _prefill_name(name, value):
    # A mode registers by importing core/attend/prefill.py; until that module is imported only the shipped
    # modes exist, so it is read where it already is and never imported from here (it imports torch and the layer).
    prefill = sys.modules.get("scissorhands.core.attend.prefill")
    names = tuple(getattr(prefill, "PREFILLS", PREFILL_MODES))
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{name}: must be a registered prefill mode ({', '.join(names)}), got {value!r}")
    return value


def _decode_name(name, value):
    # As for prefill modes: the registry is read where core/layer/decode.py is already imported, never imported here.
    static = sys.modules.get("scissorhands.core.layer.decode")
    names = tuple(getattr(static, "DECODES", DECODE_MODES))
    if not isinstance(value, str) or value not in names:
        raise ValueError(f"{name}: must be a registered decode mode ({', '.join(names)}), got {value!r}")
    return value


def _group_size(name, value):
    value = s.integer(4)(name, value)
    if value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= 4, got {value}")
    return value




def _demote(name, value):
    if value is None:
        return None
    return parse_tiers(value)


_KV = "packed K/V"
_PREFILL = "prefill"


@dataclass(frozen=True)
class CacheSettings:
    """How a budgeted cache evicts, whatever its budget.

    Every field's meaning, default and range is in its declaration below (and
    in docs/usage.md's settings table, which is generated from them). Read
    :mod:`scissorhands.core.tokens.importance` for the bucketed window, and
    docs/quantization.md for packed K/V.
    """

    # Chosen by measurement on SmolLM2-135M (docs/results.md, "Choosing the defaults by measurement").
    recent: int | float = setting(
        0.25, "the *r* most recently appended tokens are never evicted: a count, or a fraction of each layer's budget",
        s.parse_count_or_fraction, s.fraction_or_count(0, fraction_closed_low=True), metavar="R")
    sinks: int = setting(0, "the first *k* tokens of a sequence are never evicted", s.parse_int, s.integer(0),
                         metavar="K")
    window: int | None = setting(
        None, "history window *w* in steps; `None` = whole history (H2O)", s.parse_optional_int,
        s.integer(1, allow_none=True), metavar="W|none")
    window_buckets: int | None = setting(
        8, "accumulators per token per KV head representing the window; `None` = exact per-step window",
        s.parse_optional_int, s.integer(1, allow_none=True), metavar="N|none")
    drop: float | int = setting(
        0.05, "drop amount *m*: fraction of the layer budget (float) or token count (int)",
        s.parse_count_or_fraction, s.fraction_or_count(1, fraction_closed_low=False), metavar="M")
    rounds: bool = setting(
        False, "evict in rounds: a full layer chooses its `drop` lowest-scoring tokens at once, and they leave one "
        "per new token, oldest first (the layer stays at its budget, and scoring runs once per `drop` steps: the "
        "vLLM adapter's eviction, [below](#eviction-in-rounds))", s.parse_bool, s.boolean, switch=True)
    prefill_drop: float | int | None = setting(
        None, "streamed prefill: tokens evicted at each compression event of a chunk of several tokens (a "
        "fraction of the layer budget, or a count); `None` = `drop`, which makes a chunk exactly token-by-token "
        "decoding. Larger means fewer, cheaper events; the peak stays the budget",
        s.parse_optional_count_or_fraction, s.fraction_or_count(1, fraction_closed_low=False, allow_none=True),
        metavar="M|none")
    importance: str = setting(
        "mean", '`"sum"` of attention probabilities, `"count"` of queries where it exceeded 1/n, or `"mean"` '
        "(sum / queries in the window)", s.parse_text, s.one_of(IMPORTANCE_FORMS), metavar="|".join(IMPORTANCE_FORMS))
    value_weighted: bool = setting(False, "multiply importance by the value norm", s.parse_bool, s.boolean,
                                   switch=True)
    merge: bool = setting(False, "fold evicted tokens into the most similar kept token instead of dropping them",
                          s.parse_bool, s.boolean, switch=True)
    schedule: str | tuple[int, ...] = setting(
        "uniform", '`"uniform"`, `"increasing"` (later layers more, same total), a list of budgets, or a JSON file',
        s.parse_schedule, _schedule, metavar="uniform|increasing|b1,b2,...|FILE.json")
    increasing_slope: float = setting(
        0.5, '`"increasing"` schedule: the last layer gets 1 + slope times the average, the first 1 - slope',
        s.parse_float, s.real(0.0, 1.0))
    query_tile: int = setting(64, "most query rows scored at once (bounds a block's probabilities to tile x budget)",
                              s.parse_int, s.integer(1), metavar="N")
    prefill: str = setting(
        "stream", '`"stream"` (peak = budget) or `"prompt-aware"` (hold the prompt once, score it by its last queries)',
        s.parse_text, _prefill_name, group=_PREFILL, metavar="|".join(PREFILL_MODES))
    decode: str = setting(
        "dynamic", '`"dynamic"` (compact slots planned on the host), `"static"` (fixed shapes and no host '
        'synchronisation: ready for GPUs and graph capture) or `"compiled"` (the static step under `torch.compile`); '
        "the same tokens are kept ([below](#a-decode-step-with-fixed-shapes))", s.parse_text,
        _decode_name, metavar="|".join(DECODE_MODES))
    observe: int = setting(32, "prompt-aware prefill: how many of the prompt's last queries score it", s.parse_int,
                           s.integer(1), group=_PREFILL, metavar="N")
    prompt_chunk: int | None = setting(
        None, "prompt-aware prefill: take the prompt this many tokens at a time, each chunk held beside the budget "
        "and evicted back to it by its own last queries, so the peak is budget + chunk; `None` = the whole prompt "
        "at once (peak = the prompt)", s.parse_optional_int, s.integer(1, allow_none=True), group=_PREFILL,
        metavar="C|none")
    pool: int = setting(7, "prompt-aware prefill: max-pool width over neighbouring slots (odd), so a fact spanning "
                        "several tokens stays whole; 1 = none", s.parse_int, _odd, group=_PREFILL, metavar="N")
    kv_bits: int | None = setting(
        None, "bits per stored K/V element: `None`/16 = the model's dtype; 8, 4 or 2 = packed, quantised once per "
        "token ([below](#packed-low-bit-kv))", s.parse_optional_int, s.integer(2, allow_none=True, choices=KV_BITS),
        group=_KV, metavar="16|8|4|2")
    kv_key_bits: int | None = setting(
        None, "bits per key element when packed (`None` = `kv_bits`); 8-bit keys help 4-bit values when there is no "
        "residual", s.parse_optional_int, s.integer(2, allow_none=True, choices=KV_BITS[:-1]), group=_KV,
        metavar="8|4|2")
    kv_group_size: int = setting(
        32, "channels per quantisation group along head_dim (a float16 scale and zero-point each)", s.parse_int,
        _group_size, group=_KV, metavar="G")
    kv_key_centers: str | None = setting(
        None, "packed K/V: a JSON file of per-channel key centres (`scissorhands calibrate`); keys are quantised "
        "around them", s.parse_optional_text, _path, group=_KV, metavar="FILE.json")
    kv_tile: int = setting(
        512, "packed K/V: the most stored slots attention dequantises at once (keys, then values, tile by tile)",
        s.parse_int, s.integer(1), group=_KV, metavar="N")
    kv_residual: int | None = setting(
        None, "packed K/V: keep each row's newest R tokens also in full precision; every query reads its last R "
        "tokens exact. `None` = 32, at most each layer's recent window; 0 = none; a number must fit the recent "
        "window", s.parse_optional_int, s.integer(0, allow_none=True), group=_KV, metavar="R")
    kv_demote: tuple[tuple[int, float], ...] | None = setting(
        None, "demotion before eviction: widths above `kv_bits`, each with the share of a layer's budget that may "
        "hold it or wider, e.g. `16:0.1,4:0.5`; the least important tokens lose bits first, and only tokens at "
        "`kv_bits` are evicted ([below](#demotion-before-eviction))", s.parse_optional_text, _demote, group=_KV,
        metavar="BITS:SHARE,...")
    kv_store: str | None = setting(
        None, "the K/V store by name (`scissorhands.core.stores.STORES`); `None` = `dense`, or `packed` when "
        "`kv_bits` is below 16", s.parse_optional_text, _store_name, group=_KV, metavar="NAME")
    preset: str | None = setting(
        None, '`"paper"`: the published setting (w = 400 exact, r = 10, m = 0.4·B, `sum`); fields you set to other '
        "values win", s.parse_optional_text, s.one_of(("paper",), allow_none=True), metavar="paper")

    def __post_init__(self):
        if self.preset is not None:
            self._apply_preset()
        s.validate(self)
        # Checks that tie fields together (each field's own check is in its declaration).
        if isinstance(self.schedule, tuple):
            for b in self.schedule:
                check_int("schedule", b, self.protected + 1)
        if self.kv_key_bits is not None and not self.quantized:
            raise ValueError(f"kv_key_bits: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
        if self.kv_key_centers is not None and not self.quantized:
            raise ValueError(f"kv_key_centers: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
        if self.kv_demote is not None:
            if not self.quantized:
                raise ValueError(f"kv_demote: needs kv_bits 2 or 4 (the width demoted tokens end at), got "
                                 f"kv_bits={self.kv_bits}")
            check_tiers(self.kv_demote, self.kv_bits)
            if self.kv_key_bits is not None:
                raise ValueError(f"kv_key_bits: cannot be combined with kv_demote (keys and values share one chain "
                                 f"of widths), got kv_key_bits={self.kv_key_bits}")
            if self.kv_store not in (None, "tiered"):
                raise ValueError(f"kv_store: kv_demote needs the tiered store, got kv_store={self.kv_store!r}")
            if self.merge:
                raise ValueError("kv_demote: cannot be combined with merge")
            if self.prefill != "stream":
                raise ValueError(f"kv_demote: needs prefill='stream' (a prompt held whole would not fit the widths' "
                                 f"pools), got prefill={self.prefill!r}")
        if self.prompt_chunk is not None and self.prefill != "prompt-aware":
            raise ValueError(f"prompt_chunk: needs prefill='prompt-aware' (a streamed prefill already holds at most "
                             f"the budget), got prefill={self.prefill!r}")
        # The shipped fixed-shape step's needs; a registered mode checks its own when it makes a layer's step.
        if self.decode in ("static", "compiled"):
            for name, bad in (("kv_bits", self.quantized), ("kv_store", self.kv_store not in (None, "dense")),
                              ("merge", self.merge), ("value_weighted", self.value_weighted)):
                if bad:
                    raise ValueError(f"decode: {self.decode!r} needs the dense store without merge or "
                                     f"value_weighted, got {name}={getattr(self, name)!r}")
        if self.rounds:
            for name, bad in (("merge", self.merge), ("kv_demote", self.kv_demote is not None),
                              ("decode", self.decode != "dynamic")):
                if bad:
                    raise ValueError(f"rounds: cannot be combined with {name}={getattr(self, name)!r}")
        if self.kv_residual:
            if not self.lossy:
                raise ValueError(f"kv_residual: needs a lossy store (kv_bits below 16, or a kv_store other than "
                                 f"dense), got kv_bits={self.kv_bits}")
            if self.merge:
                raise ValueError("kv_residual: cannot be combined with merge (merging rewrites kept tokens' values, "
                                 "and the residual's exact copies would go stale)")

    def _apply_preset(self) -> None:
        preset = s.one_of(tuple(PRESETS))("preset", self.preset)
        for name, value in PRESETS[preset].items():
            if getattr(self, name) == getattr(_LIBRARY_DEFAULTS, name):
                object.__setattr__(self, name, value)
        # Applied once: the values are now the fields themselves, so a later `replace` (a method's own
        # settings, a budget) cannot re-apply the preset over a value that happens to equal a default.
        object.__setattr__(self, "preset", None)

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored packed (``kv_bits`` below 16)."""
        return self.kv_bits is not None and self.kv_bits < 16

    @property
    def lossy(self) -> bool:
        """Whether K/V are stored other than exactly (packed, or a store of another name than dense)."""
        return self.quantized or self.kv_store not in (None, "dense")

    @property
    def protected(self) -> int:
        """Tokens every layer must be able to keep whatever its budget: the sinks and a whole-token recent window."""
        return (self.recent if isinstance(self.recent, int) else 0) + self.sinks

    def recent_for(self, layer_budget: int) -> int:
        """The recent window of a layer with this budget."""
        return int(self.recent * layer_budget) if isinstance(self.recent, float) else int(self.recent)

    def residual_for(self, layer_budget: int, evicts: bool = True) -> int:
        """The full-precision residual of a layer with this budget.

        ``kv_residual`` as given; by default (None) :data:`DEFAULT_RESIDUAL`
        tokens with packed K/V, at most the layer's recent window when it
        evicts (``evicts`` False: a cache that never evicts), and none without
        packing or with ``merge``.
        """
        if not self.lossy or self.merge:
            return 0
        if self.kv_residual is not None:
            return int(self.kv_residual)
        if not self.quantized:
            return 0  # a store of another name keeps a residual only when asked
        return DEFAULT_RESIDUAL if not evicts else min(DEFAULT_RESIDUAL, self.recent_for(layer_budget))

    def check_residual(self, layer_budget: int, evicts: bool = True) -> int:
        """:meth:`residual_for`, or a one-line ``ValueError`` if an explicit ``kv_residual`` cannot fit.

        An eviction never drops the recent window, which is what keeps the
        residual's tokens stored; a larger residual could lose them.
        """
        residual = self.residual_for(layer_budget, evicts)
        recent = self.recent_for(layer_budget)
        if evicts and residual > recent:
            advice = ("raise recent, lower kv_residual, or set it to 0" if self.recent else
                      "recent is 0, so no token is safe from eviction: set kv_residual to 0, or use a method "
                      "that keeps a recent window")
            raise ValueError(f"kv_residual: must be <= the recent window of every layer, so that no eviction "
                             f"touches it; a layer of budget {layer_budget} keeps {recent} recent tokens, got "
                             f"kv_residual={self.kv_residual} ({advice})")
        return residual

    def with_budget(self, budget: int) -> ScissorhandsConfig:
        """These settings at a token budget."""
        return ScissorhandsConfig(budget=budget, **self.as_dict())

    def as_dict(self) -> dict:
        """The settings fields (never the budget), for JSON records and ``replace``."""
        return {f.name: getattr(self, f.name) for f in fields(CacheSettings)}

    # -- derived quantities ---------------------------------------------------------------
    def bucket_steps(self) -> int | None:
        """Steps per importance bucket, or ``None`` for an unbounded window."""
        if self.window is None:
            return None
        n = self.window if self.window_buckets is None else min(self.window_buckets, self.window)
        return math.ceil(self.window / n)

    def n_buckets(self) -> int:
        """Number of importance accumulators kept per stored token and KV head."""
        steps = self.bucket_steps()
        return 1 if steps is None or self.window is None else math.ceil(self.window / steps)

    def drop_for(self, layer_budget: int, amount: float | int | None = None) -> int:
        """Drop amount for a layer with this budget (a fraction is rounded, then clamped)."""
        amount = self.drop if amount is None else amount
        m = max(1, round(amount * layer_budget)) if isinstance(amount, float) else int(amount)
        return max(1, min(m, layer_budget - self.recent_for(layer_budget) - self.sinks))

    def prefill_drop_for(self, layer_budget: int) -> int | None:
        """The streamed prefill's drop amount for this layer, or None when it is ``drop`` (exact streaming)."""
        return None if self.prefill_drop is None else self.drop_for(layer_budget, self.prefill_drop)


_LIBRARY_DEFAULTS = CacheSettings()

PRESETS: dict[str, dict] = {
    # The published algorithm: importance summed over an exact 400-step window, 10 recent tokens, drop 0.4 B,
    # no sinks, streamed prefill.
    "paper": {"recent": 10, "window": 400, "window_buckets": None, "drop": 0.4, "importance": "sum", "sinks": 0,
              "value_weighted": False, "merge": False, "prefill": "stream", "kv_residual": 0},
}

DEFAULTS = CacheSettings()
"""The shipped defaults: the one definition the CLI and the lm-eval backend read theirs from."""


@dataclass(frozen=True, kw_only=True)
class ScissorhandsConfig(CacheSettings):
    """What a :class:`~scissorhands.hf.cache.ScissorhandsCache` keeps and how it evicts.

    The fields of :class:`CacheSettings`, plus:

    Parameters
    ----------
    budget : int
        Average number of tokens each full-attention layer may store; the
        schedule spreads ``budget * n_layers`` over the layers. It is a peak:
        no layer ever stores more than its own budget.
    """

    budget: int = setting(REQUIRED, "average tokens stored per full-attention layer; each layer's own budget is a "
                          "hard peak", s.parse_int, s.integer(1), metavar="B")

    def __post_init__(self):
        super().__post_init__()
        if self.budget <= self.protected:
            what = f"recent ({self.recent})" if not self.sinks else f"recent + sinks ({self.protected})"
            raise ValueError(f"budget: must be > {what}, got {self.budget}")
        for name in ("drop", "prefill_drop"):
            amount = getattr(self, name)
            if amount is None or isinstance(amount, float):
                continue
            if amount >= self.budget:
                raise ValueError(f"{name}: must be < budget ({self.budget}), got {amount}")
            room = self.budget - self.recent_for(self.budget) - self.sinks
            if amount > room:
                raise ValueError(f"{name}: must be <= budget - recent - sinks ({room}), got {amount}")

    @property
    def settings(self) -> CacheSettings:
        """Everything but the budget."""
        return CacheSettings(**self.as_dict())

    def with_budget(self, budget: int) -> ScissorhandsConfig:
        return replace(self, budget=budget)


def settings_rows() -> list:
    """Every declared setting, the budget first: what the CLI, the lm-eval backend and docs/usage.md show."""
    rows = declared(ScissorhandsConfig)
    return [r for r in rows if r[0] == "budget"] + [r for r in rows if r[0] != "budget"]


def readme_table() -> str:
    """The settings table of docs/usage.md (a test keeps the two equal)."""
    return settings_table(settings_rows())
