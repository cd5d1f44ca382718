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


_store_name = s.registered("scissorhands.core.stores.registry", "STORES", STORE_NAMES, "store", allow_none=True)


def _path(name, value):
    return s.optional_path(name, os.fspath(value) if isinstance(value, os.PathLike) else value)


def _group_size(name, value):
    value = s.integer(4)(name, value)
    if value & (value - 1):
        raise ValueError(f"{name}: must be a power of two >= 4, got {value}")
    return value


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
    """How K/V are stored: the model's dtype, or packed to fewer bits, with a residual and demotion."""

    kv_bits: int | None = setting(
        None, "bits per stored K/V element: `None`/16 = the model's dtype; 8, 4 or 2 = packed, quantised once per "
        "token ([below](#packed-low-bit-kv))", s.parse_optional_int, s.integer(2, allow_none=True, choices=KV_BITS),
        group=GROUP, metavar="16|8|4|2")
    kv_key_bits: int | None = setting(
        None, "bits per key element when packed (`None` = `kv_bits`); 8-bit keys help 4-bit values when there is no "
        "residual", s.parse_optional_int, s.integer(2, allow_none=True, choices=KV_BITS[:-1]), group=GROUP,
        metavar="8|4|2")
    kv_group_size: int = setting(
        32, "channels per quantisation group along head_dim (a float16 scale and zero-point each)", s.parse_int,
        _group_size, group=GROUP, metavar="G")
    kv_key_centers: str | None = setting(
        None, "packed K/V: a JSON file of per-channel key centres (`scissorhands calibrate`); keys are quantised "
        "around them (rotary centres, measured before RoPE, turn with each token's position: Qwen2's 4-bit keys). "
        "With `memory`, the store measured with such centres becomes a candidate", s.parse_optional_text, _path,
        group=GROUP, metavar="FILE.json")
    kv_tile: int = setting(
        512, "packed K/V: the most stored slots attention dequantises at once (keys, then values, tile by tile)",
        s.parse_int, s.integer(1), group=GROUP, metavar="N")
    kv_residual: int | None = setting(
        None, "packed K/V: keep each row's newest R tokens also in full precision; every query reads its last R "
        "tokens exact. `None` = 32, at most each layer's recent window; 0 = none; a number must fit the recent "
        "window", s.parse_optional_int, s.integer(0, allow_none=True), group=GROUP, metavar="R")
    kv_demote: tuple[tuple[int, float], ...] | None = setting(
        None, "demotion before eviction: widths above `kv_bits`, each with the share of a layer's budget that may "
        "hold it or wider, e.g. `16:0.3,4:0.6` (or `16:0.3;4:0.6`, which lm-eval's comma-split model arguments "
        "keep whole); the least important tokens lose bits first, and only tokens at `kv_bits` are evicted "
        "([below](#demotion-before-eviction))", s.parse_optional_text, _demote, group=GROUP, metavar="BITS:SHARE,...")
    kv_store: str | None = setting(
        None, "the K/V store by name (`scissorhands.core.stores.STORES`); `None` = `dense`, or `packed` when "
        "`kv_bits` is below 16", s.parse_optional_text, _store_name, group=GROUP, metavar="NAME")

    def check(self) -> None:
        """The rules that tie this group's fields together (each field's own check is in its declaration)."""
        if self.kv_key_bits is not None and not self.quantized:
            raise ValueError(f"kv_key_bits: needs packed K/V (kv_bits below 16), got kv_bits={self.kv_bits}")
        # kv_key_centers without packed K/V is refused when a cache is planned (core/planning/assembly.py): with
        # memory= the store is chosen there, and centres are for whichever packed store it chooses.
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
        if self.quantized and self.kv_store == "dense":
            raise ValueError(f"kv_store: 'dense' keeps K/V in the model's dtype, so kv_bits={self.kv_bits} would not "
                             f"be used; leave kv_store unset (packed) or choose a store that packs")
        if self.kv_residual and not self.lossy:
            raise ValueError(f"kv_residual: needs a lossy store (kv_bits below 16, or a kv_store other than "
                             f"dense), got kv_bits={self.kv_bits}")

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored packed (``kv_bits`` below 16)."""
        return self.kv_bits is not None and self.kv_bits < 16

    @property
    def lossy(self) -> bool:
        """Whether K/V are stored other than exactly (packed, or a store of another name than dense)."""
        return self.quantized or self.kv_store not in (None, "dense")
