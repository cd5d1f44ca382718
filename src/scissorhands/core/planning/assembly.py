"""Where a cache is assembled: settings, a method, the model's layer count and protection in; one plan out.

Every entry point (``ScissorhandsCache`` and ``for_memory``, the command line, eval, bench, the lm-eval
backend, the vLLM adapter) builds its layers from :func:`plan`, so each rule is applied here once: the method
resolves its own settings over the user's (once), a memory target chooses the store and the token budget,
the budget is split across layers, every layer is checked for room to evict beside the protected tokens, and
each layer's full-precision residual is fixed. The plan then hands out each layer finished
(:meth:`CachePlan.layer`), or its parts: its store, its prefill mode and its per-token state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..settings.config import CacheSettings, ScissorhandsConfig
from ..settings.declare import integer
from ..settings.heads import MIN_WINDOW
from ..settings.schedule import layer_budgets
from ..tokens.protect import Protection, check_room

if TYPE_CHECKING:
    import torch

    from ..attend.prefill import Prefill
    from ..facts import ModelFacts
    from ..layer.budgeted import BudgetedKV
    from ..layer.heads import HeadGroups
    from ..methods.base import EvictionMethod
    from ..stores.base import KVStore
    from ..stores.centers import RotaryCenters
    from ..tokens.state import TokenState
    from .memory_target import MemoryChoice, Shape


@dataclass(frozen=True)
class LayerPlan:
    """One budgeted layer: tokens kept, the recent window never evicted, tokens evicted at once, and the newest
    tokens also kept at full precision beside a lossy store (0: none). With head-level budgets
    (``head_budgets``), ``groups`` splits its KV heads, each group a layer of its own over those heads."""

    budget: int
    recent: int
    drop: int
    residual: int
    groups: tuple[HeadGroupPlan, ...] = ()


@dataclass(frozen=True)
class HeadGroupPlan:
    """KV heads of one layer that share a budget: retrieval heads (the method's eviction) or streaming heads
    (sinks and the most recent tokens, :mod:`..methods.streaming`)."""

    heads: tuple[int, ...]
    budget: int
    recent: int
    drop: int
    residual: int
    retrieval: bool


@dataclass(frozen=True)
class CachePlan:
    """What a cache is made of: the settings after the method's own (``config``), the method, one
    :class:`LayerPlan` per budgeted layer, the protected spans, and what a memory target chose (or None)."""

    config: ScissorhandsConfig
    method: EvictionMethod
    layers: tuple[LayerPlan, ...]
    protection: Protection | None = None
    memory_choice: MemoryChoice | None = None

    def store(self, layer: int, key_center: torch.Tensor | RotaryCenters | None = None,
              group: HeadGroupPlan | None = None) -> KVStore:
        """Layer ``layer``'s K/V store (the settings' store, wrapped in its residual), or one head group's."""
        from ..stores import make_store

        return make_store(self.config, key_center, (group or self.layers[layer]).residual)

    def prefill(self, layer: int, group: HeadGroupPlan | None = None) -> Prefill:
        """Layer ``layer``'s prefill mode, with its settings (at one head group's budget if given)."""
        from ..attend.prefill import Streamed, make_prefill

        made = make_prefill(self.config, (group or self.layers[layer]).budget)
        if self.memory_choice is not None:  # a peak promised: no round's victims held beside the budget
            for part in (made, getattr(made, "stream", None)):
                if isinstance(part, Streamed):
                    part.block_rounds = False
        return made

    def state(self, group: HeadGroupPlan | None = None) -> TokenState | None:
        """A fresh per-token state for one layer or head group (its method's)."""
        return self.group_method(group).make_state(self.config)

    def layer(self, layer: int, layer_idx: int | None = None,
              key_center: torch.Tensor | RotaryCenters | None = None) -> BudgetedKV | HeadGroups:
        """Budgeted layer ``layer`` (the ``layer``-th full-attention layer) finished, as the model's layer
        ``layer_idx`` (default ``layer``): its store, prefill mode, per-token state, shields and eviction mode
        from the plan, needing no check of its own; with head-level budgets, its head groups, each a budgeted layer
        of its own over those heads."""
        from ..layer.budgeted import BudgetedKV

        part, c = self.layers[layer], self.config
        idx = layer if layer_idx is None else layer_idx
        if part.groups:
            from ..layer.heads import HeadGroups

            return HeadGroups([(g.heads, BudgetedKV(
                g.budget, g.recent, g.drop, self.group_method(g), self.state(g), idx, self.store(layer, group=g),
                sinks=c.sinks, merge=c.merge, prefill=self.prefill(layer, g), decode=c.decode, rounds=c.rounds,
                protect=self.protection if g.retrieval else None)) for g in part.groups])
        return BudgetedKV(part.budget, part.recent, part.drop, self.method, self.state(), idx,
                          self.store(layer, key_center), sinks=c.sinks, merge=c.merge, prefill=self.prefill(layer),
                          protect=self.protection, decode=c.decode, rounds=c.rounds)

    def group_method(self, group: HeadGroupPlan | None) -> EvictionMethod:
        """The method of a head group: the cache's for retrieval heads, StreamingLLM's for streaming heads."""
        if group is None or group.retrieval:
            return self.method
        from ..methods.streaming import Streaming

        return Streaming()


def plan(settings: CacheSettings, n_layers: int, method: EvictionMethod | None = None, *,
         protection: Protection | None = None, protect_name: str = "protect", memory=None,
         shape: Shape | None = None, length: int | None = None, facts: ModelFacts | None = None) -> CachePlan:
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
    facts : ModelFacts, optional
        The model's attention facts: what a head ranking (``head_budgets``) is checked against.
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
        if settings.head_budgets is not None:
            raise ValueError("head_budgets: cannot be combined with memory= (a memory target plans one budget for "
                             "every head)")
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
    if config.head_budgets is not None and not method.is_full:
        layers = _split_heads(config, layers, facts, protection, protect_name)
    return CachePlan(config, method, tuple(layers), protection, choice)


def _split_heads(config: ScissorhandsConfig, layers: list[LayerPlan], facts: ModelFacts | None,
                 protection: Protection | None, protect_name: str) -> list[LayerPlan]:
    """Each layer's KV heads in groups by their budget (:mod:`.heads`); a layer whose heads all keep its budget
    stays one group."""
    from dataclasses import replace

    from ..settings.heads import STREAMING_SINKS
    from .heads import HeadRanking, head_budgets, head_groups, retrieval_heads

    if facts is None or config.head_budgets is None:
        raise ValueError("head_budgets: needs the model's layers and KV heads (a transformers model)")
    ranking = HeadRanking.load(config.head_budgets)
    ranking.check_model(facts.model_type, facts.full_layers, facts.num_kv_heads)
    budgets = [p.budget for p in layers]
    windows = []
    for b in budgets:
        w = config.head_window
        if w is None:
            w = max(MIN_WINDOW, config.recent_for(b) + config.sinks)
        if w >= b:
            raise ValueError(f"head_window: a streaming head's window ({w}) must be < its layer's budget ({b})")
        if w <= config.sinks + STREAMING_SINKS:
            raise ValueError(f"head_window: a streaming head's window ({w}) must be > its sinks "
                             f"({config.sinks + STREAMING_SINKS}: sinks + StreamingLLM's {STREAMING_SINKS})")
        windows.append(w)
    retrieval = retrieval_heads(ranking.scores, config.retrieval_share)
    per_head = head_budgets(retrieval, budgets, windows)
    out = []
    for p, row, hi in zip(layers, per_head, retrieval):
        groups = head_groups(row, hi)
        if len(groups) == 1 and groups[0][2] and groups[0][1] == p.budget:
            out.append(p)  # every head a retrieval head at the layer's budget: the uniform layer
            continue
        parts = []
        for heads, b, is_hi in groups:
            if is_hi:
                r, m = config.recent_for(b), config.drop_for(b)
                check_room(protection, [(b, r, m)], name=protect_name)
            else:  # sinks and the most recent tokens: the recent window is what is left beside the sinks
                r = min(config.recent_for(b), b - config.sinks - 1)
                m = config.drop_for(b)  # its clamp to b - recent - sinks is 1 wherever r was cut
            residual = config.check_residual(b) if is_hi else min(config.residual_for(b), r)
            parts.append(HeadGroupPlan(heads, b, r, m, residual, is_hi))
        out.append(replace(p, groups=tuple(parts)))
    return out
