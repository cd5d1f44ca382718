"""Where a cache is assembled: settings, a method, the model's layer count and protection in; one plan out.

Every entry point (``ScissorhandsCache`` and ``for_memory``, the command line, eval, bench, the lm-eval
backend, the vLLM adapter) builds its layers from :func:`plan`, so each rule is applied here once: the method
resolves its own settings over the user's (once), a budget as given (a token count, a fraction of the
sequence's length, or a memory target that chooses the store and the token budget) becomes tokens
(:func:`budget_tokens` is the one place a fraction does), the budget is split across layers, every layer is
checked for room to evict beside the protected tokens, and each layer's full-precision residual is fixed. The
plan then hands out each layer finished (:meth:`CachePlan.layer`), or its parts: its store, its prefill mode and
its per-token state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..settings.budget import check_budget_spec
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
    #: Key centres by the model's layer index, read from ``kv_key_centers`` once the model's facts are known.
    centres: dict | None = field(default=None, compare=False, repr=False)
    #: The model's attention facts the plan was made for (checked supported), or None (planned by layer count).
    facts: ModelFacts | None = field(default=None, compare=False, repr=False)

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
              key_center: torch.Tensor | RotaryCenters | None = None, *, store: KVStore | None = None,
              prefill: Prefill | None | str = "plan", rounds: bool | None = None,
              method: EvictionMethod | None = None) -> BudgetedKV | HeadGroups:
        """Budgeted layer ``layer`` (the ``layer``-th full-attention layer) finished, as the model's layer
        ``layer_idx`` (default ``layer``): its store, prefill mode, per-token state, shields and eviction mode
        from the plan, needing no check of its own; with head-level budgets, its head groups, each a budgeted layer
        of its own over those heads.

        An adapter that keeps K/V its own way gives the parts it holds (``store``, ``prefill``, ``rounds``,
        ``method``: the vLLM adapter's prompt over vLLM's blocks); the rest is the plan's.
        """
        from ..layer.budgeted import BudgetedKV

        part, c = self.layers[layer], self.config
        idx = layer if layer_idx is None else layer_idx
        if key_center is None and self.centres is not None:
            key_center = self.centres.get(idx)
        if part.groups:
            if store is not None or prefill != "plan" or rounds is not None or method is not None:
                raise ValueError("layer: a layer split into head groups takes its parts from the plan alone")
            from ..layer.heads import HeadGroups

            return HeadGroups([(g.heads, BudgetedKV(
                g.budget, g.recent, g.drop, self.group_method(g), self.state(g), idx, self.store(layer, group=g),
                sinks=c.sinks, merge=c.merge, prefill=self.prefill(layer, g), decode=c.decode, rounds=c.rounds,
                protect=self.protection if g.retrieval else None)) for g in part.groups])
        method = self.method if method is None else method
        return BudgetedKV(part.budget, part.recent, part.drop, method, method.make_state(c), idx,
                          self.store(layer, key_center) if store is None else store, sinks=c.sinks, merge=c.merge,
                          prefill=self.prefill(layer) if prefill == "plan" else prefill, protect=self.protection,
                          decode=c.decode, rounds=c.rounds if rounds is None else rounds)

    # -- bytes -------------------------------------------------------------------------------------
    def layer_kv_bytes(self, layer: int, shape: Shape, held: float | None = None, rows: int = 1) -> float:
        """K/V bytes ``rows`` sequences hold in budgeted layer ``layer`` at ``held`` tokens each (default its
        budget; never more): the store's own byte model (``KVStore.bytes_for``: elements, packed or not, scales
        and zero-points, a tiered store's pools at their shares) and its full-precision residual, per sequence,
        and the layer's key centres, once. ``shape``'s ``layers`` is not read. Dense and packed stores cost the
        same per token, so a fractional ``held`` (a mean over sequences) is exact; a demoting store is sized at
        the nearest whole budget."""
        from dataclasses import replace

        from ..stores import STORES, store_name
        from .memory_target import centre_bytes, store_bytes

        part, c = self.layers[layer], self.config
        n = part.budget if held is None else min(part.budget, held)
        one = replace(shape, layers=1)
        centres = centre_bytes(c, shape)
        if c.kv_demote is not None:  # pools are shares of a layer's budget
            one_row = store_bytes(c.with_budget(max(1, round(n))), one, not self.method.is_full)
            return rows * (one_row - centres) + centres
        dense = (shape.head_dim_k + shape.head_dim_v) * shape.itemsize
        per_head = STORES[store_name(c)].bytes_for(c, one, 1)
        per_head = dense if per_head is None else per_head  # a store that declares no byte model: the dtype's
        return rows * shape.kv_heads * (n * per_head + min(part.residual, n) * dense) + centres

    def kv_bytes(self, shape: Shape, held: float | None = None, rows: int = 1) -> float:
        """K/V bytes ``rows`` sequences hold over every budgeted layer (:meth:`layer_kv_bytes`, each at its own
        budget from the schedule)."""
        return sum(self.layer_kv_bytes(i, shape, held, rows) for i in range(len(self.layers)))

    def peak_bytes(self, shape: Shape) -> int:
        """Everything one sequence holds at its peak over the budgeted layers: the K/V store with its residual
        and centres, the importance state and an int32 position per slot, each layer at its own budget (what a
        memory target plans with: :func:`scissorhands.core.planning.memory_target.peak_bytes`)."""
        from dataclasses import replace

        from .memory_target import peak_bytes

        one = replace(shape, layers=1)
        return sum(peak_bytes(self.config.with_budget(p.budget), one, not self.method.is_full) for p in self.layers)

    def group_method(self, group: HeadGroupPlan | None) -> EvictionMethod:
        """The method of a head group: the cache's for retrieval heads, StreamingLLM's for streaming heads."""
        if group is None or group.retrieval:
            return self.method
        from ..methods.streaming import Streaming

        return Streaming()


def _method(method: EvictionMethod | type[EvictionMethod] | None) -> EvictionMethod:
    """The method as an instance: default Scissorhands; a class (as the registry holds them) instantiated."""
    if method is None:
        from ..methods.scissorhands import Scissorhands

        return Scissorhands()
    return method() if isinstance(method, type) else method


def budget_tokens(spec, length: int | None, settings: CacheSettings,
                  method: EvictionMethod | type[EvictionMethod] | None = None, name: str = "budget") -> int:
    """A layer's token budget for a budget as the user gave it: a token count as is, a fraction of ``length``
    (the sequence's tokens, prompt and new ones) rounded, never below the method's protected tokens + 1 (its
    recent window and sinks, after its own settings: the smallest budget that leaves one token to evict).

    The one place a fractional budget becomes tokens (:func:`plan` calls it; so do tools that report a
    budget without building a cache). A fraction without ``length`` is a one-line ``ValueError``.
    """
    return _tokens(spec, length, _method(method).resolve(settings).protected, name)


def check_budget(spec, settings: CacheSettings, method: EvictionMethod | type[EvictionMethod] | None = None,
                 name: str = "budget") -> float | int:
    """A budget as given, checked against the settings before anything is loaded: a fraction in (0, 1], or a token
    count above the method's protected tokens (its recent window and sinks); one-line ``ValueError`` naming
    ``name``. The plan checks the same when it makes the budget tokens."""
    return _checked(spec, _method(method).resolve(settings).protected, name)


def _checked(spec, protected: int, name: str) -> float | int:
    value = check_budget_spec(spec, name)
    if isinstance(value, int) and value <= protected:
        raise ValueError(f"{name}: a token count must be > recent + sinks ({protected}), got {value}; lower recent "
                         "or raise the budget")
    return value


def _tokens(spec, length: int | None, protected: int, name: str = "budget") -> int:
    """A fraction rounded to tokens of this sequence, never below ``protected + 1`` (short sequences at a small
    fraction hit this floor: their compression is then below the nominal one, and the evaluation records the
    budget actually used); a count as is, refused at or below ``protected``."""
    value = _checked(spec, protected, name)
    if isinstance(value, float):
        if length is None:
            raise ValueError(f"{name}: a fraction ({value:g}) needs the sequence's length to become tokens")
        return max(round(value * length), protected + 1)
    return value


def check_given(budget, memory, method=None) -> None:
    r"""The budget as given, checked before anything is loaded: a token budget or a memory target, not both, each
    well formed, and a memory target for a method that evicts (one-line ``ValueError``\ s naming ``budget`` or
    ``memory``). :func:`plan` checks the same."""
    if budget is not None and memory is not None:
        raise ValueError("memory: give memory or budget, not both")
    if memory is not None and getattr(method, "is_full", False):
        raise ValueError("memory: method=full evicts nothing; give an evicting method")
    if budget is not None:
        check_budget_spec(budget, "budget")
    if memory is not None:
        from .memory_target import parse_memory

        parse_memory(memory)


def check_plan(settings: CacheSettings, method: EvictionMethod | type[EvictionMethod] | None = None, *,
               budget=None, memory=None) -> float | int | None:
    """What :func:`plan` refuses before it needs the model or the sequence, checked at once (an entry point calls
    this before a model loads; the plan calls it first): a token budget or a memory target, each well formed, a
    token count above the method's protected tokens, no setting a memory target would override, and a schedule
    file read. Returns the budget as given (a fraction or a token count), or None for a memory target or the
    settings' own budget. One-line ``ValueError``s naming the parameter."""
    check_given(budget, memory, method)
    schedule = getattr(settings, "schedule", None)  # (a value of another type is refused by the plan)
    if isinstance(schedule, str) and schedule.endswith(".json"):
        from ..settings.schedule import load_schedule

        load_schedule(schedule)
    if memory is not None:
        from .memory_target import check_memory_settings

        check_memory_settings(settings)
        if settings.head_budgets is not None:
            raise ValueError("head_budgets: cannot be combined with memory= (a memory target plans one budget for "
                             "every head)")
        return None
    if budget is not None:
        return check_budget(budget, settings, method)
    return None


def plan(settings: CacheSettings, n_layers: int, method: EvictionMethod | None = None, *,
         protection: Protection | None = None, protect_name: str = "protect", budget=None, memory=None,
         shape: Shape | None = None, length: int | None = None, facts: ModelFacts | None = None) -> CachePlan:
    """The plan of a cache of ``n_layers`` budgeted layers.

    Parameters
    ----------
    settings : CacheSettings
        The user's settings; a ``ScissorhandsConfig`` (with its budget) unless ``budget`` or ``memory`` is given.
    n_layers : int
        Budgeted (full-attention) layers.
    method : EvictionMethod, optional
        Default Scissorhands. Its own settings (TOVA's window of 1, H2O's sum, ...) are applied here, once.
    protection : Protection, optional
        Spans never evicted; a layer left no room to evict is a one-line ``ValueError`` naming
        ``protect_name``.
    budget : int or float, optional
        The budget as given: a token count, or a fraction of ``length`` (:func:`budget_tokens`); it replaces
        the settings' own.
    memory, shape, length
        A memory target (a fraction of the full cache's K/V bytes, or a size per sequence), the model's K/V
        shape and the sequence length: the store and token budget are chosen for them
        (:func:`scissorhands.core.planning.memory_target.choose`) and kept as ``memory_choice``.
    facts : ModelFacts, optional
        The model's attention facts: what a head ranking (``head_budgets``) and a key-centre file
        (``kv_key_centers``, read here, handed out with each layer) are checked against.
    """
    method = _method(method)
    choice = None
    check_plan(settings, method, budget=budget, memory=memory)
    if budget is not None:
        resolved = method.resolve(settings)  # the method's own settings, resolved once
        config = resolved.with_budget(_tokens(budget, length, resolved.protected))
    elif memory is not None:
        from .memory_target import choose

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
    if config.kv_key_centers is not None and config.merge:
        from ..stores.centers import centers_frame

        if centers_frame(config.kv_key_centers) == "rotary":
            raise ValueError("kv_key_centers: rotary centres (a format-2 file) cannot be combined with merge=True "
                             "(a merge rewrites keys whose positions differ between KV heads)")
    if facts is not None:
        facts.check_supported()
    centres = None
    if config.kv_key_centers is not None and facts is not None:  # read once, checked against the model
        from ..stores.centers import load_key_centers

        centres = load_key_centers(config.kv_key_centers, facts)
    budgets = layer_budgets(config, n_layers)
    if config.prefill != "keep-prompt":  # spans in a kept prompt sit beside the budget: checked at the prompt
        check_room(protection, [(b, config.recent_for(b), config.drop_for(b)) for b in budgets], name=protect_name)
    layers = []
    for b in budgets:
        if b <= config.protected:
            raise ValueError(f"schedule: a layer budget ({b}) must be > the protected tokens "
                             f"(recent + sinks = {config.protected})")
        layers.append(LayerPlan(b, config.recent_for(b), config.drop_for(b),
                                config.check_residual(b, evicts=not method.is_full)))
    if config.head_budgets is not None and not method.is_full:
        layers = _split_heads(config, layers, facts, protection, protect_name)
    return CachePlan(config, method, tuple(layers), protection, choice, centres, facts)


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
