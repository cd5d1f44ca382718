"""What an eviction method is: a rule that scores stored tokens, seen through a read-only view of a layer.

Selection (drop the lowest scores, at least ``m`` at a time, never the recent
window or protected slots, ties towards the newer token) and the gather that
compacts K/V and every per-token state live once, in the layer. A method only
says how much each stored token is worth keeping, and, if it needs memory of
its own, supplies a :class:`~scissorhands.core.tokens.state.TokenState` that the layer
keeps aligned with K/V.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from ..settings.config import DEFAULTS, CacheSettings, ScissorhandsConfig
from ..tokens.state import TokenState

if TYPE_CHECKING:
    from ..tokens.slots import SlotTable

logger = logging.getLogger(__name__)
Settings = TypeVar("Settings", bound=CacheSettings)


class LayerView:
    """What a method may read of one budgeted layer at an eviction. Nothing here is to be written.

    Attributes
    ----------
    layer_idx : int
        The layer's index in the model.
    length : int
        Slots in use (the longest row's stored length); every tensor covers these.
    compressions : int
        Evictions this layer has made so far in this sequence.
    state : TokenState or None
        The method's own per-layer state (from :meth:`EvictionMethod.make_state`).
    prompt_attention : Tensor of shape (B, H_kv, length), or None
        Set only while a prompt-aware prefill scores the prompt it holds: the
        attention the prompt's last ``observe`` queries paid each slot, summed
        over a group's query heads (:class:`~scissorhands.core.attend.prefill.PromptAware`).
        Methods that score by attention score by it then.
    """

    __slots__ = ("layer_idx", "length", "compressions", "state", "prompt_attention", "_slots", "_read")

    def __init__(self, layer_idx: int, length: int, compressions: int, state: TokenState | None,
                 slots: SlotTable, read: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                 prompt_attention: torch.Tensor | None = None):
        self.layer_idx = layer_idx
        self.length = length
        self.compressions = compressions
        self.state = state
        self.prompt_attention = prompt_attention
        self._slots = slots
        self._read = read

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens stored per row, LongTensor of shape (B,), CPU."""
        return self._slots.lengths

    @property
    def seen(self) -> torch.Tensor:
        """Real tokens each row has seen, LongTensor of shape (B,), CPU; the last query's step is ``seen - 1``."""
        return self._slots.seen

    @property
    def positions(self) -> torch.Tensor:
        """Position of the token in each slot, IntTensor of shape (B, H_kv, length); -1 for empty slots."""
        return self._slots.positions[:, :, : self.length]

    def keys(self) -> torch.Tensor:
        """Stored keys (dequantised if the store is packed), shape (B, H_kv, length, D)."""
        return self._read(self.length)[0]

    def values(self) -> torch.Tensor:
        """Stored values (dequantised if the store is packed), shape (B, H_kv, length, D_v)."""
        return self._read(self.length)[1]


class EvictionMethod:
    """Base class of eviction methods: subclass, set ``name``, override :meth:`score`, and register.

    Class attributes
    ----------------
    name : str
        The registry key (``--methods NAME``).
    description : str
        One line for ``--help`` and the methods table in docs/usage.md.
    settings : dict
        Cache settings this method fixes, whatever the user's (e.g. H2O's
        unbounded window); they override the shared :class:`CacheSettings`.
    is_full : bool
        True only for the full cache, which evicts nothing.
    stackable : bool
        True when :meth:`score` treats each row alone and reads neither ``layer_idx`` nor ``compressions``, so the
        views of several layers stacked along the rows score as each layer alone would: the vLLM plugin then
        scores every layer's round of a step in one call. False (the safe default): one call per layer.

    Parameters
    ----------
    seed : int
        For methods that draw random numbers.
    """

    name: ClassVar[str] = "base"
    description: ClassVar[str] = ""
    settings: ClassVar[dict[str, object]] = {}
    is_full: ClassVar[bool] = False
    stackable: ClassVar[bool] = False
    #: Whether :meth:`score` ranks a held prompt by the view's ``prompt_attention`` alone, never by what the
    #: prompt's own queries left in the layer's state (a method whose state wants no attention need not say so).
    held_prompt_by_snapshot: ClassVar[bool] = False

    def __init__(self, seed: int = 0):
        self.seed = seed

    @classmethod
    def resolve(cls, base: Settings) -> Settings:
        """The shared settings with this method's own choices applied: the one place they are applied.

        Every entry point (``ScissorhandsCache``, the CLI, the scorer, eval, the
        lm-eval backend) goes through here, so one method and one base give one
        configuration. A setting the method fixes wins over the base; when the
        base held a value of its own there (not the library default), a
        warning names both values. Applying it twice changes nothing.
        """
        overrides: dict[str, Any] = {k: v for k, v in cls.settings.items() if getattr(base, k) != v}
        for name, value in overrides.items():
            given = getattr(base, name)
            if given != getattr(DEFAULTS, name):
                logger.warning("%s: method %r fixes %s=%r; the given %s=%r is not used", name, cls.name, name,
                               value, name, given)
        axes = {k: overrides.pop(k) for k in list(overrides) if k in base.plugin_axes}
        out = replace(base, **overrides) if overrides else base
        for axis, name in axes.items():  # another plug-in on an axis: the settings the given one owned go
            out = out.with_plugin(axis, name)
        dropped = sorted(dict(base.owned).keys() - dict(out.owned).keys())
        if dropped:
            logger.warning("%s: method %r fixes %s, whose plug-ins do not take them; not used", ", ".join(dropped),
                           cls.name, ", ".join(f"{a}={n!r}" for a, n in axes.items()))
        return out

    @classmethod
    def configure(cls, base: CacheSettings, budget: int) -> ScissorhandsConfig:
        """A full cache configuration for this method at ``budget`` tokens."""
        return cls.resolve(base).with_budget(budget)

    def make_state(self, config: CacheSettings) -> TokenState | None:
        """A fresh per-layer state, or None if the method needs none."""
        return None

    def score(self, view: LayerView) -> torch.Tensor:
        """Keep-worthiness of the stored slots.

        Parameters
        ----------
        view : LayerView

        Returns
        -------
        Tensor, shape (B, H_kv, view.length), float32
            Higher means keep. The recent window, empty slots and protected
            slots are handled by the layer.
        """
        raise NotImplementedError(f"{type(self).__name__}.score")
