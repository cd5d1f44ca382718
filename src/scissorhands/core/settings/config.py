"""Frozen, validated configuration for budgeted KV eviction.

:class:`CacheSettings` holds everything but the budget: what callers that
resolve a budget per sequence (the evaluation grid, the lm-eval backend, the
analysis) carry around. :class:`ScissorhandsConfig` adds the budget.

The settings come in groups, a module each: eviction (:mod:`.eviction`), the
schedule (:mod:`.schedule`), prefill (:mod:`.prefill`), the layer's steps
(:mod:`.step`) and storage (:mod:`.storage`). Each group checks the rules among
its own fields; this module composes them, flat (``settings.kv_bits``), and
holds only the rules that cross groups and the preset. Each field is declared
once (:func:`~.declare.setting`): its default, its help, how it is parsed from
text and how it is checked. The CLI flags, the lm-eval and vLLM arguments and
docs/usage.md's settings table are derived from those declarations. Every bad
value raises ``ValueError`` whose message starts with the parameter's name, so
the entry points print it as one line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from . import declare as s
from .declare import REQUIRED, declared, setting, settings_table
from .eviction import IMPORTANCE_FORMS, EvictionSettings
from .heads import HeadSettings
from .prefill import PREFILL_MODES, PrefillSettings
from .schedule import SCHEDULES, ScheduleSettings
from .step import DECODE_MODES, StepSettings
from .storage import DEFAULT_RESIDUAL, KV_BITS, STORE_NAMES, StorageSettings, check_demotion, check_residual

__all__ = ["DECODE_MODES", "DEFAULTS", "DEFAULT_RESIDUAL", "IMPORTANCE_FORMS", "KV_BITS", "PREFILL_MODES",
           "PRESETS", "SCHEDULES", "STORE_NAMES", "CacheSettings", "ScissorhandsConfig", "check_int",
           "readme_table", "settings_rows"]

GROUPS = (EvictionSettings, ScheduleSettings, PrefillSettings, StepSettings, StorageSettings, HeadSettings)
"""The settings' groups, in the order their fields are listed (flags, the settings table)."""


def check_int(name: str, value, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an integer >= ``low``."""
    s.integer(low)(name, value)


@dataclass(frozen=True)
class CacheSettings(HeadSettings, StorageSettings, StepSettings, PrefillSettings, ScheduleSettings,
                    EvictionSettings):
    """How a budgeted cache evicts, whatever its budget: the groups' fields, flat.

    Every field's meaning, default and range is in its declaration, in its
    group's module (and in docs/usage.md's settings table, which is generated
    from them). Read :mod:`scissorhands.core.tokens.importance` for the
    bucketed window, and docs/quantization.md for packed K/V.
    """

    preset: str | None = setting(
        None, '`"paper"`: the published setting (w = 400 exact, r = 10, m = 0.4·B, `sum`); fields you set to other '
        "values win", s.parse_optional_text, s.one_of(("paper",), allow_none=True), metavar="paper")
    owned: tuple[tuple[str, Any], ...] = field(default=())
    """The settings plug-ins own (:func:`~.declare.own`), those given other than their defaults, by name. Pass
    and read them by name like any other (``CacheSettings(prefill="prompt-aware", observe=16).observe``)."""

    plugin_axes = {"schedule": "schedule", "prefill": "prefill", "decode": "decode", "kv_store": "kv_store"}
    """The fields that name a plug-in whose settings it may own, each with the field its settings follow."""

    def __post_init__(self):
        if self.preset is not None:
            self._apply_preset()
        s.validate(self)
        object.__setattr__(self, "owned", s.check_owned(self, tuple(self.owned)))
        for group in GROUPS:  # each group's own rules, in its own module
            check = vars(group).get("check")
            if check is not None:
                check(self)
        self._check_across_groups()

    def plugin(self, axis: str, owned: dict | None = None) -> Any:
        """The plug-in ``axis`` chooses: the field's value; for the store, the one ``kv_store`` names or the
        settings imply (:meth:`~.storage.StorageSettings.store`)."""
        return self.store(owned) if axis == "kv_store" else getattr(self, axis)

    def _check_across_groups(self) -> None:
        """The rules that tie fields of different groups together."""
        if isinstance(self.schedule, tuple):
            for b in self.schedule:
                check_int("schedule", b, self.protected + 1)
        if self.kv_demote is not None:
            check_demotion(merge=self.merge)
            if self.prefill != "stream":
                raise ValueError(f"kv_demote: needs prefill='stream' (a prompt held whole would not fit the widths' "
                                 f"pools), got prefill={self.prefill!r}")
        if self.decode != "dynamic":
            for name, bad in (("kv_bits", self.quantized), ("kv_store", self.kv_store not in (None, "dense")),
                              ("merge", self.merge), ("value_weighted", self.value_weighted)):
                if bad:
                    raise ValueError(f"decode: {self.decode!r} needs the dense store without merge or "
                                     f"value_weighted, got {name}={getattr(self, name)!r}")
        if self.prefill == "keep-prompt" and self.decode != "dynamic":
            raise ValueError(f"prefill: 'keep-prompt' keeps a prompt of each row's own length beside the budget, "
                             f"which needs decode='dynamic', got decode={self.decode!r}")
        if self.rounds:
            for name, bad in (("kv_demote", self.kv_demote is not None), ("decode", self.decode != "dynamic")):
                if bad:
                    raise ValueError(f"rounds: cannot be combined with {name}={getattr(self, name)!r}")
        if self.kv_residual:
            check_residual(self.kv_residual, None, merge=self.merge)  # its fit to each layer: check_residual below
        if self.head_budgets is not None:
            for name, bad, why in (
                    ("prefill", self.prefill == "keep-prompt", "a streaming head would hold the whole prompt"),
                    ("kv_demote", self.kv_demote is not None, "a demotion's widths are planned for one budget"),
                    ("kv_key_centers", self.kv_key_centers is not None, "the centres are read for a whole layer"),
                    ("decode", self.decode != "dynamic", "the fixed-shape step needs an importance state, which a "
                     "streaming head does not keep"),
                    ("merge", self.merge, "a streaming head keeps its sinks and window, nothing merged into them")):
                if bad:
                    raise ValueError(f"head_budgets: cannot be combined with {name}={getattr(self, name)!r} ({why})")

    def _apply_preset(self) -> None:
        preset = s.one_of(tuple(PRESETS))("preset", self.preset)
        for name, value in PRESETS[preset].items():
            if getattr(self, name) == getattr(_LIBRARY_DEFAULTS, name):
                object.__setattr__(self, name, value)
        # Applied once: the values are now the fields themselves, so a later `replace` (a method's own
        # settings, a budget) cannot re-apply the preset over a value that happens to equal a default.
        object.__setattr__(self, "preset", None)

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
        """:meth:`residual_for`, or a one-line ``ValueError`` if an explicit ``kv_residual`` cannot fit."""
        residual = self.residual_for(layer_budget, evicts)
        check_residual(residual, self.recent_for(layer_budget), merge=self.merge, evicts=evicts,
                       layer_budget=layer_budget, recent_setting=self.recent)
        return residual

    def with_budget(self, budget: int) -> ScissorhandsConfig:
        """These settings at a token budget."""
        return ScissorhandsConfig(budget=budget, **self.as_dict())

    def as_dict(self) -> dict:
        """Every setting (never the budget), the registered plug-ins' own included, by name: for JSON records
        and ``CacheSettings(**...)``."""
        return {name: getattr(self, name) for name, _, _ in declared(CacheSettings)}

    def with_plugin(self, axis: str, name: str):
        """These settings with ``axis`` set to the plug-in ``name``, less what other plug-ins of it own."""
        keep = tuple((k, v) for k, v in self.owned if s.OWNED[k].axis != axis or name in s.OWNED[k].owners)
        changes: dict[str, Any] = {axis: name, "owned": keep}
        return replace(self, **changes)

    def __getattr__(self, name: str) -> Any:
        """A plug-in's own setting: its given value, or its default."""
        owner = s.OWNED.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return dict(self.__dict__.get("owned", ())).get(name, owner.default)

    def prefill_drop_for(self, layer_budget: int) -> int | None:
        """The streamed prefill's drop amount for this layer, or None when it is ``drop`` (exact streaming)."""
        return None if self.prefill_drop is None else self.drop_for(layer_budget, self.prefill_drop)


def _taking_owned(cls):
    """Let ``cls(...)`` (and ``dataclasses.replace``) take plug-in-owned settings by name, into ``owned``."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        mine = {k: kwargs.pop(k) for k in [k for k in kwargs if k in s.OWNED]}
        if mine:
            kwargs["owned"] = tuple({**dict(kwargs.get("owned", ())), **mine}.items())
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_taking_owned(CacheSettings)
s.RESERVED.update(f.name for f in fields(CacheSettings))
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


_taking_owned(ScissorhandsConfig)
s.RESERVED.add("budget")
#: Names the classes already answer (methods, properties): a plug-in's setting of that name would be hidden.
s.RESERVED.update(n for n in dir(ScissorhandsConfig) if not n.startswith("_"))


def settings_rows() -> list:
    """Every declared setting, the budget first: what the CLI, the lm-eval backend and docs/usage.md show."""
    rows = declared(ScissorhandsConfig)
    return [r for r in rows if r[0] == "budget"] + [r for r in rows if r[0] != "budget"]


def readme_table() -> str:
    """The settings table of docs/usage.md (a test keeps the two equal)."""
    return settings_table(settings_rows())
