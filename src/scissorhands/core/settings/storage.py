"""The storage settings: how a layer stores K/V (bits, groups, residual, demotion, the store by name).

One group of :class:`~.config.CacheSettings` (the stores it configures are
:mod:`scissorhands.core.stores`), with the rules that tie its fields together and the residual's and
demotion's rules, which a layer built by hand checks with the same functions (:func:`check_residual`,
:func:`check_demotion`). This module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import declare as s
from .declare import setting
from .tiers import check_tiers, parse_tiers

KV_BITS = (2, 4, 8, 16)
STORE_NAMES = ("dense", "packed", "tiered")  # the shipped stores; any registered one is taken (stores/registry.py)
GROUP = "packed K/V"

DEFAULT_RESIDUAL = 32
"""Tokens of full-precision residual a packed cache keeps by default (``kv_residual=None``).

Measured on SmolLM2-135M (docs/quantization.md, docs/results.md): 4-bit K/V
cost +0.040 nats/token without it and +0.003 with the newest 32 tokens exact;
128 tokens brought nothing more."""


_store_name = s.registered("kv_store", STORE_NAMES, "store", allow_none=True)


def _path(name, value):
    return s.optional_path(name, os.fspath(value) if isinstance(value, os.PathLike) else value)


def _group_size(name, value):
    value = s.integer(4)(name, value)
    if value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= 4, got {value}")
    return value


def _bits(name, value):
    value = s.integer(2, allow_none=True, choices=KV_BITS)(name, value)
    return None if value == 16 else value  # 16 bits is the model's dtype: no packing, the same as None


def _demote(name, value):
    if value is None:
        return None
    return parse_tiers(value)


def check_residual(residual: int, recent: int | None, *, merge: bool, evicts: bool = True,
                   layer_budget: int | None = None, recent_setting=None) -> None:
    """The full-precision residual's rules, for the settings and for a layer built by hand.

    Merging rewrites kept tokens' values, so exact copies of them would go stale; and an eviction never drops
    the recent window, which is what keeps the residual's tokens stored, so a larger residual could lose them.
    ``recent`` None: the layer's recent window is not known yet (the settings without a budget).
    """
    if residual and merge:
        raise ValueError("kv_residual: cannot be combined with merge (merging rewrites kept tokens' values, "
                         "and the residual's exact copies would go stale)")
    if recent is not None and evicts and residual > recent:
        where = f"a layer of budget {layer_budget}" if layer_budget is not None else "this layer"
        advice = ("raise recent, lower kv_residual, or set it to 0" if recent_setting is None or recent_setting else
                  "recent is 0, so no token is safe from eviction: set kv_residual to 0, or use a method "
                  "that keeps a recent window")
        raise ValueError(f"kv_residual: must be <= the recent window of every layer, so that no eviction "
                         f"touches it; {where} keeps {recent} recent tokens, got kv_residual={residual} ({advice})")


def check_demotion(*, merge: bool, evicts: bool = True) -> None:
    """What demotion cannot be combined with, for the settings and for a layer built by hand."""
    if merge:
        raise ValueError("kv_demote: cannot be combined with merge")
    if not evicts:
        raise ValueError("kv_demote: the full cache scores no tokens, so it cannot demote any")


@dataclass(frozen=True)
class StorageSettings:
    """How K/V are stored: the store (by name, or implied by ``kv_bits``), the width, a residual beside it.

    The settings every store reads stay here: ``kv_bits`` (which also chooses the packed store when no store is
    named), ``kv_residual`` (the wrapper any lossy store can have) and ``kv_key_centers`` (which ``memory=``
    reads before it has chosen a store). The packed stores' own settings are :class:`PackedSettings` and
    :class:`TieredSettings` below, valid only while their store is the chosen one (:meth:`store`).
    """

    kv_bits: int | None = setting(
        None, "bits per stored K/V element: `None`/16 = the model's dtype; 8, 4 or 2 = packed, quantised once per "
        "token ([below](#packed-low-bit-kv))", s.parse_optional_int, _bits, group=GROUP, metavar="16|8|4|2")
    kv_key_centers: str | None = setting(
        None, "packed K/V: a JSON file of per-channel key centres (`scissorhands calibrate`); keys are quantised "
        "around them (rotary centres, measured before RoPE, turn with each token's position: Qwen2's 4-bit keys). "
        "With `memory`, the store measured with such centres becomes a candidate", s.parse_optional_text, _path,
        group=GROUP, metavar="FILE.json")
    kv_residual: int | None = setting(
        None, "packed K/V: keep each row's newest R tokens also in full precision; every query reads its last R "
        "tokens exact. `None` = 32, at most each layer's recent window; 0 = none; a number must fit the recent "
        "window", s.parse_optional_int, s.integer(0, allow_none=True), group=GROUP, metavar="R")
    kv_store: str | None = setting(
        None, "the K/V store by name (`scissorhands.core.stores.STORES`); `None` = `dense`, or `packed` when "
        "`kv_bits` is below 16, or `tiered` with `kv_demote`", s.parse_optional_text, _store_name, group=GROUP,
        metavar="NAME")

    def check(self) -> None:
        """The rules that tie this group's fields together (each field's own check is in its declaration)."""
        # kv_key_centers without packed K/V is refused when a cache is planned (core/planning/assembly.py): with
        # memory= the store is chosen there, and centres are for whichever packed store it chooses.
        demote = getattr(self, "kv_demote", None)  # the tiered store's, whose widths end at kv_bits
        if demote is not None:
            check_tiers(demote, self.kv_bits)
        if self.store() in ("packed", "tiered") and not self.quantized:
            raise ValueError(f"kv_bits: the {self.store()} store packs K/V to 8, 4 or 2 bits, got "
                             f"kv_bits={self.kv_bits}")
        if self.quantized and self.store() == "dense":
            raise ValueError(f"kv_store: 'dense' keeps K/V in the model's dtype, so kv_bits={self.kv_bits} would not "
                             f"be used; leave kv_store unset (packed) or choose a store that packs")
        if self.kv_residual and not self.lossy:
            raise ValueError(f"kv_residual: needs a lossy store (kv_bits below 16, or a kv_store other than "
                             f"dense), got kv_bits={self.kv_bits}")

    def store(self, owned: dict | None = None) -> str:
        """The store these settings choose: ``kv_store``, else ``tiered`` with ``kv_demote``, else ``packed`` for
        ``kv_bits`` below 16, else ``dense``. ``owned``: the plug-ins' settings as given, while they are checked."""
        if self.kv_store is not None:
            return self.kv_store
        demote = (dict(getattr(self, "owned", ())) if owned is None else owned).get("kv_demote")
        return "tiered" if demote is not None else "packed" if self.quantized else "dense"

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored packed (``kv_bits`` below 16)."""
        return self.kv_bits is not None and self.kv_bits < 16

    @property
    def lossy(self) -> bool:
        """Whether K/V are stored other than exactly (packed, or a store of another name than dense)."""
        return self.quantized or self.kv_store not in (None, "dense")


@dataclass(frozen=True)
class PackedSettings:
    """The settings of the packed store (:class:`~scissorhands.core.stores.packed.PackedKVStore`), which owns
    them (and the tiered store, built on it): valid only while it is the chosen store (:func:`~.declare.own`)."""

    kv_key_bits: int | None = setting(
        None, "packed K/V: bits per key element (`None` = `kv_bits`); 8-bit keys help 4-bit values when there is "
        "no residual", s.parse_optional_int, s.integer(2, allow_none=True, choices=KV_BITS[:-1]), group=GROUP,
        metavar="8|4|2")
    kv_group_size: int = setting(
        32, "packed K/V: channels per quantisation group along head_dim (a float16 scale and zero-point each)",
        s.parse_int, _group_size, group=GROUP, metavar="G")
    kv_tile: int = setting(
        512, "packed K/V: the most stored slots attention dequantises at once (keys, then values, tile by tile)",
        s.parse_int, s.integer(1), group=GROUP, metavar="N")


@dataclass(frozen=True)
class TieredSettings(PackedSettings):
    """The tiered store's settings (:class:`~scissorhands.core.stores.tiered.TieredKVStore`): the packed ones and
    the widths it demotes through, valid only while it is the chosen store (``kv_demote`` chooses it)."""

    kv_demote: tuple[tuple[int, float], ...] | None = setting(
        None, "demotion before eviction: widths above `kv_bits`, each with the share of a layer's budget that may "
        "hold it or wider, e.g. `16:0.3;4:0.6` (a semicolon, which lm-eval's comma-split model arguments keep "
        "whole; elsewhere a comma also separates them); the least important tokens lose bits first, and only "
        "tokens at `kv_bits` are evicted "
        "([below](#demotion-before-eviction)); it chooses the tiered store", s.parse_optional_text, _demote,
        group=GROUP, metavar="BITS:SHARE,...")

    def check(self) -> None:
        if self.kv_key_bits is not None:
            raise ValueError(f"kv_key_bits: cannot be combined with kv_demote (keys and values share one chain "
                             f"of widths), got kv_key_bits={self.kv_key_bits}")


s.own("kv_store", "packed", PackedSettings)
s.own("kv_store", "tiered", TieredSettings)
