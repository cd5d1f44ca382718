"""Where a cache is assembled: settings, a method, the model's layer count and protection in; one plan out.

Every entry point (``ScissorhandsCache`` and ``for_memory``, the command line, eval, bench, the lm-eval
backend, the vLLM adapter) builds its layers from :func:`plan`, so each rule is applied here once: the method
resolves its own settings over the user's (once), a memory target chooses the store and the token budget,
the budget is split across layers, every layer is checked for room to evict beside the protected tokens, and
each layer's full-precision residual is fixed. The plan then makes each layer's parts: its store, its prefill
mode and its per-token state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..settings.config import CacheSettings, ScissorhandsConfig
from ..settings.declare import integer
from ..settings.schedule import layer_budgets
from ..tokens.protect import Protection, check_room

if TYPE_CHECKING:
    import torch

    from ..attend.prefill import Prefill
    from ..methods.base import EvictionMethod
    from ..stores.base import KVStore
    from ..stores.centers import RotaryCenters
    from ..tokens.state import TokenState
    from .memory_target import MemoryChoice, Shape


@dataclass(frozen=True)
class LayerPlan:
    """One budgeted layer: tokens kept, the recent window never evicted, tokens evicted at once, and the newest
    tokens also kept at full precision beside a lossy store (0: none)."""

    budget: int
    recent: int
    drop: int
    residual: int


@dataclass(frozen=True)
class CachePlan:
    """What a cache is made of: the settings after the method's own (``config``), the method, one
    :class:`LayerPlan` per budgeted layer, the protected spans, and what a memory target chose (or None)."""

    config: ScissorhandsConfig
    method: EvictionMethod
    layers: tuple[LayerPlan, ...]
    protection: Protection | None = None
    memory_choice: MemoryChoice | None = None

    def store(self, layer: int, key_center: torch.Tensor | RotaryCenters | None = None) -> KVStore:
        """Layer ``layer``'s K/V store (the settings' store, wrapped in its residual)."""
        from ..stores import make_store

        return make_store(self.config, key_center, self.layers[layer].residual)

    def prefill(self, layer: int) -> Prefill:
        """Layer ``layer``'s prefill mode, with its settings."""
        from ..attend.prefill import make_prefill

        return make_prefill(self.config, self.layers[layer].budget)

    def state(self) -> TokenState | None:
        """A fresh per-token state for one layer (the method's)."""
        return self.method.make_state(self.config)


def plan(settings: CacheSettings, n_layers: int, method: EvictionMethod | None = None, *,
         protection: Protection | None = None, protect_name: str = "protect", memory=None,
         shape: Shape | None = None, length: int | None = None) -> CachePlan:
    """The plan of a cache of ``n_layers`` budgeted layers.

    Parameters
    ----------
    settings : CacheSettings
        The user's settings; a ``ScissorhandsConfig`` (with its budget) unless ``memory`` is given.
    n_layers : int
        Budgeted (full-attention) layers.
    method : EvictionMethod, optional
        Default Scissorhands. Its own settings (TOVA's window of 1, H2O's sum, ...) are applied here, once.
    protection : Protection, optional
        Spans never evicted; a layer left no room to evict is a one-line ``ValueError`` naming
        ``protect_name``.
    memory, shape, length
        A memory target (a fraction of the full cache's K/V bytes, or a size per sequence), the model's K/V
        shape and the sequence length: the store and token budget are chosen for them
        (:func:`scissorhands.core.planning.memory_target.choose`) and kept as ``memory_choice``.
    """
    if method is None:
        from ..methods.scissorhands import Scissorhands

        method = Scissorhands()
    elif isinstance(method, type):  # a method class, as the registry holds them
        method = method()
    choice = None
    if memory is not None:
        from .memory_target import check_memory_settings, choose

        check_memory_settings(settings)
        if shape is None:
            raise ValueError("memory: needs the model's K/V shape to choose a budget")
        length = integer(1)("length", length)  # the sequence's tokens (prompt + new ones): a whole number >= 1
        choice = choose(memory, shape, length, method.resolve(settings))
        config = method.resolve(choice.config)  # the method's own settings hold over the chosen store too
    else:
        if not isinstance(settings, ScissorhandsConfig):
            raise ValueError(f"config: must be a ScissorhandsConfig (settings with a budget), got "
                             f"{type(settings).__name__}")
        config = method.resolve(settings)
    if config.kv_key_centers is not None and not config.quantized:
        raise ValueError(f"kv_key_centers: needs packed K/V (kv_bits below 16) or memory=, got "
                         f"kv_bits={config.kv_bits}")
    budgets = layer_budgets(config, n_layers)
    if config.prefill != "keep-prompt":  # spans in a kept prompt sit beside the budget: checked at the prompt
        check_room(protection, [(b, config.recent_for(b), config.drop_for(b)) for b in budgets], name=protect_name)
    layers = []
    for budget in budgets:
        if budget <= config.protected:
            raise ValueError(f"schedule: a layer budget ({budget}) must be > the protected tokens "
                             f"(recent + sinks = {config.protected})")
        layers.append(LayerPlan(budget, config.recent_for(budget), config.drop_for(budget),
                                config.check_residual(budget, evicts=not method.is_full)))
    return CachePlan(config, method, tuple(layers), protection, choice)
