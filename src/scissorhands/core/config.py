"""Frozen, validated configuration for budgeted KV eviction.

:class:`CacheSettings` holds everything but the budget: what callers that
resolve a budget per sequence (the evaluation grid, the lm-eval backend, the
analysis) carry around. :class:`ScissorhandsConfig` adds the budget. Every bad
value raises ``ValueError`` whose message starts with the parameter's name, so
the CLI can print it as a one-line error.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace
from pathlib import Path

IMPORTANCE_FORMS = ("sum", "count", "mean")
SCHEDULES = ("uniform", "increasing")
PREFILL_MODES = ("stream", "prompt-aware")
KV_BITS = (2, 4, 8, 16)


def check_int(name: str, value, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name}: must be >= {low}, got {value}")


@dataclass(frozen=True)
class CacheSettings:
    """How a budgeted cache evicts, whatever its budget.

    Parameters
    ----------
    recent : int or float
        The ``r`` most recently appended tokens are never evicted. A float in
        [0, 1) is a fraction of each layer's budget (rounded down).
    sinks : int
        The first ``k`` tokens of every sequence are never evicted (attention sinks).
    window : int or None
        History window ``w``: importance counts the queries of the last ``w``
        steps. ``None`` means the whole history (the H2O end of the family).
    window_buckets : int or None
        How many buckets of steps represent the window. Each stored token keeps
        one accumulator per bucket, so the importance state costs
        ``window_buckets`` numbers per token per KV head instead of ``window``.
        The window then spans between ``w - s + 1`` and ``w`` steps, with
        ``s = ceil(w / window_buckets)``. ``None`` gives one bucket per step: exact.
    drop : float or int
        Drop amount ``m``. A float in (0, 1) is a fraction of each layer's
        budget; an int is a token count. At least ``m`` tokens go at each
        compression, so compression runs once every ``m`` decode steps.
    importance : {"sum", "count", "mean"}
        ``sum`` adds attention probabilities; ``count`` counts the queries
        in which a token's probability exceeded ``1/n`` (n = tokens attended);
        ``mean`` is ``sum`` divided by the number of queries that scored the
        token inside the window, so a token that arrived late is not judged
        by fewer queries than an old one.
    value_weighted : bool
        Multiply importance by the norm of the token's value vector (attention
        that moves a large value matters more).
    merge : bool
        Fold each evicted token's value into the kept token with the most
        similar key, carrying its weight as a logit bias (see :mod:`.merging`),
        instead of dropping it.
    schedule : str, sequence of int, or path
        ``"uniform"``, ``"increasing"`` (later layers get more, same total),
        an explicit list of per-layer budgets, or a path to a JSON schedule.
    increasing_slope : float
        For ``"increasing"``: the last layer gets ``1 + slope`` times the
        average and the first ``1 - slope`` times, linearly in between.
    query_tile : int
        Most query rows scored at once while prefilling; bounds the size of
        the probability block to ``query_tile x budget`` per head.
    prefill : {"stream", "prompt-aware"}
        ``stream`` feeds a long prompt through the budget (peak memory = the
        budget; the prompt's tokens are judged by the prompt's own attention).
        ``prompt-aware`` holds the whole first chunk (the prompt) once, scores
        its tokens by the attention of its last ``observe`` queries (usually the
        question), and evicts down to the budget before decoding (peak memory =
        the prompt's length).
    observe : int
        For ``prompt-aware``: how many of the prompt's last queries score it.
    kv_bits : {None, 16, 8, 4, 2}
        Bits per stored K/V element. ``None`` or 16 keeps K/V in the model's
        dtype; 8, 4 or 2 packs them (see :mod:`.quant`), with a float16 scale
        and zero-point per group. With the ``full`` method this is a quantised
        cache without eviction.
    kv_key_bits : {None, 8, 4, 2}
        Bits per stored key element when K/V are packed; ``None`` takes
        ``kv_bits``. Keys lose more than values to per-token groups: 8-bit
        keys with 4-bit values cost about what 8-bit K/V cost
        (docs/quantization.md).
    kv_group_size : int
        Channels per quantisation group along the head dimension (a smaller
        head is one group); each group costs 4 bytes of scale and zero-point.
    kv_key_centers : str or None
        With packed K/V: a JSON file of per-channel key centres for this model
        (``scissorhands calibrate``); keys are quantised around them, which
        halves the 4-bit loss (docs/quantization.md).
    kv_tile : int
        With packed K/V: the most stored slots attention dequantises at once.
        Keys, then values, are read back tile by tile, so the transient dense
        copy is one tile, not a whole layer (:func:`.kernel.attend_stored`).
    kv_residual : int or None
        With packed K/V: each query reads the newest ``kv_residual`` tokens
        (its own included) exact, from a full-precision copy of each row's
        newest tokens kept beside the packed ones (:mod:`.residual`); 0 for
        none. The copy costs that many tokens in the model's dtype per layer,
        row and KV head, counted in the memory report. A number must fit in
        every layer's recent window, so that an eviction never touches it.
        ``None`` (the default) takes :data:`DEFAULT_RESIDUAL` tokens with
        packed K/V, at most each layer's recent window (see
        :meth:`residual_for`); it cuts the 4-bit loss by about 90%.
    preset : str or None
        ``"paper"`` reproduces the published algorithm (see :data:`PRESETS`):
        its values replace the library defaults; any field set to a
        non-default value is kept as given. It is applied when the settings
        are made, and the field then reads None.
    """

    # Chosen by measurement on SmolLM2-135M (docs/results.md, "Choosing the defaults by measurement").
    recent: int | float = 0.25
    window: int | None = None
    window_buckets: int | None = 8
    drop: float | int = 0.05
    importance: str = "mean"
    schedule: str | tuple[int, ...] = "uniform"
    increasing_slope: float = 0.5
    query_tile: int = 64
    sinks: int = 0
    value_weighted: bool = False
    merge: bool = False
    prefill: str = "stream"
    observe: int = 32
    kv_bits: int | None = None
    kv_key_bits: int | None = None
    kv_group_size: int = 32
    kv_key_centers: str | None = None
    kv_tile: int = 512
    kv_residual: int | None = None
    preset: str | None = None

    def __post_init__(self):
        if self.preset is not None:
            self._apply_preset()
        if isinstance(self.recent, float):
            if not 0.0 <= self.recent < 1.0:
                raise ValueError(f"recent: a fractional recent window must be in [0, 1), got {self.recent}")
        else:
            check_int("recent", self.recent, 0)
        check_int("sinks", self.sinks, 0)
        for flag in ("value_weighted", "merge"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}: must be True or False, got {getattr(self, flag)!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill: must be one of {PREFILL_MODES}, got {self.prefill!r}")
        check_int("observe", self.observe, 1)
        if self.window is not None:
            check_int("window", self.window, 1)
        if self.window_buckets is not None:
            check_int("window_buckets", self.window_buckets, 1)
        if isinstance(self.drop, bool) or not isinstance(self.drop, (numbers.Integral, float)):
            raise ValueError(f"drop: must be a fraction in (0, 1) or a token count, got {self.drop!r}")
        if isinstance(self.drop, float):
            if not 0.0 < self.drop < 1.0:
                raise ValueError(f"drop: a fractional drop must be in (0, 1), got {self.drop}")
        else:
            check_int("drop", self.drop, 1)
        if self.importance not in IMPORTANCE_FORMS:
            raise ValueError(f"importance: must be one of {IMPORTANCE_FORMS}, got {self.importance!r}")
        if isinstance(self.schedule, list):
            object.__setattr__(self, "schedule", tuple(self.schedule))
        if isinstance(self.schedule, Path):
            object.__setattr__(self, "schedule", str(self.schedule))
        if isinstance(self.schedule, tuple):
            for b in self.schedule:
                check_int("schedule", b, self.protected + 1)
        elif not isinstance(self.schedule, str):
            raise ValueError(f"schedule: must be a name, a list of budgets or a JSON path, got {self.schedule!r}")
        elif self.schedule not in SCHEDULES and not self.schedule.endswith(".json"):
            raise ValueError(
                f"schedule: must be one of {SCHEDULES}, a list of budgets or a .json file, got {self.schedule!r}"
            )
        if not 0.0 <= self.increasing_slope < 1.0:
            raise ValueError(f"increasing_slope: must be in [0, 1), got {self.increasing_slope}")
        check_int("query_tile", self.query_tile, 1)
        if self.kv_bits is not None and (isinstance(self.kv_bits, bool) or self.kv_bits not in KV_BITS):
            raise ValueError(f"kv_bits: must be one of {KV_BITS} or None, got {self.kv_bits!r}")
        if self.kv_key_bits is not None:
            if isinstance(self.kv_key_bits, bool) or self.kv_key_bits not in KV_BITS[:-1]:
                raise ValueError(f"kv_key_bits: must be one of {KV_BITS[:-1]} or None, got {self.kv_key_bits!r}")
            if not self.quantized:
                raise ValueError(f"kv_key_bits: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
        check_int("kv_group_size", self.kv_group_size, 1)
        if self.kv_group_size & (self.kv_group_size - 1) or self.kv_group_size < 4:
            raise ValueError(f"kv_group_size: must be a power of two >= 4, got {self.kv_group_size}")
        check_int("kv_tile", self.kv_tile, 1)
        if self.kv_key_centers is not None:
            if not isinstance(self.kv_key_centers, str) or not self.kv_key_centers.strip():
                raise ValueError(f"kv_key_centers: must be a file path, got {self.kv_key_centers!r}")
            if not self.quantized:
                raise ValueError(f"kv_key_centers: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
        if self.kv_residual is not None:
            check_int("kv_residual", self.kv_residual, 0)
        if self.kv_residual:
            if not self.quantized:
                raise ValueError(f"kv_residual: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
            if self.merge:
                raise ValueError("kv_residual: cannot be combined with merge (merging rewrites kept tokens' values, "
                                 "and the residual's exact copies would go stale)")

    def _apply_preset(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: must be one of {tuple(PRESETS)}, got {self.preset!r}")
        for name, value in PRESETS[self.preset].items():
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
        if not self.quantized or self.merge:
            return 0
        if self.kv_residual is not None:
            return int(self.kv_residual)
        return DEFAULT_RESIDUAL if not evicts else min(DEFAULT_RESIDUAL, self.recent_for(layer_budget))

    def check_residual(self, layer_budget: int, evicts: bool = True) -> int:
        """:meth:`residual_for`, or a one-line ``ValueError`` if an explicit ``kv_residual`` cannot fit.

        An eviction never drops the recent window, which is what keeps the
        residual's tokens stored; a larger residual could lose them.
        """
        residual = self.residual_for(layer_budget, evicts)
        recent = self.recent_for(layer_budget)
        if evicts and residual > recent:
            raise ValueError(f"kv_residual: must be <= the recent window of every layer, so that no eviction "
                             f"touches it; a layer of budget {layer_budget} keeps {recent} recent tokens, got "
                             f"kv_residual={self.kv_residual} (raise recent, lower kv_residual, or set it to 0)")
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

    def drop_for(self, layer_budget: int) -> int:
        """Drop amount for a layer with this budget (a fraction is rounded, then clamped)."""
        m = max(1, round(self.drop * layer_budget)) if isinstance(self.drop, float) else int(self.drop)
        return max(1, min(m, layer_budget - self.recent_for(layer_budget) - self.sinks))


_LIBRARY_DEFAULTS = CacheSettings()

DEFAULT_RESIDUAL = 32
"""Tokens of full-precision residual a packed cache keeps by default (``kv_residual=None``).

Measured on SmolLM2-135M (docs/quantization.md, docs/results.md): 4-bit K/V
cost +0.040 nats/token without it and +0.003 with the newest 32 tokens exact;
128 tokens brought nothing more."""

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

    budget: int

    def __post_init__(self):
        check_int("budget", self.budget, 1)
        object.__setattr__(self, "budget", int(self.budget))
        super().__post_init__()
        if self.budget <= self.protected:
            what = f"recent ({self.recent})" if not self.sinks else f"recent + sinks ({self.protected})"
            raise ValueError(f"budget: must be > {what}, got {self.budget}")
        if not isinstance(self.drop, float):
            if self.drop >= self.budget:
                raise ValueError(f"drop: must be < budget ({self.budget}), got {self.drop}")
            room = self.budget - self.recent_for(self.budget) - self.sinks
            if self.drop > room:
                raise ValueError(f"drop: must be <= budget - recent - sinks ({room}), got {self.drop}")

    @property
    def settings(self) -> CacheSettings:
        """Everything but the budget."""
        return CacheSettings(**self.as_dict())

    def with_budget(self, budget: int) -> ScissorhandsConfig:
        return replace(self, budget=budget)
