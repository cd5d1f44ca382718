"""ScissorhandsCache: a transformers ``Cache`` whose full-attention layers hold a fixed token budget.

This module is the adapter to transformers' layered cache API and nothing
more. Each :class:`ScissorhandsLayer` wraps a :class:`~scissorhands.core.layer.budgeted.BudgetedKV`
(storage, slots, per-token state, eviction). Its ``update`` only hands the new
chunk to the registered attention function (see :mod:`scissorhands.hf.attention`),
which calls :meth:`ScissorhandsLayer.attend`; that streams the chunk through
the budgeted storage (:mod:`scissorhands.core.attend.streaming`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin

from scissorhands.core.attend.streaming import attend
from scissorhands.core.layer.audit import EvictionAudit
from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.layer.footprint import layer_memory
from scissorhands.core.layer.heads import HeadGroups
from scissorhands.core.methods import EvictionMethod
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.planning.assembly import CachePlan, plan
from scissorhands.core.settings.config import DEFAULTS, CacheSettings, ScissorhandsConfig
from scissorhands.core.tokens.protect import Protection, SpanSpec
from scissorhands.core.tokens.slots import SlotTable
from scissorhands.core.tokens.state import TokenState

from .attention import enable
from .guard import ModelGuard, check_continues, check_holds, reuse_message
from .modelinfo import FULL, model_facts
from .report import cache_memory_report

if TYPE_CHECKING:
    from scissorhands.core.facts import ModelFacts
    from scissorhands.core.planning.memory_target import MemoryChoice


class ScissorhandsLayer(CacheLayerMixin):
    """transformers' view of one budgeted layer: its storage, a core layer (:meth:`of_budget` builds one by hand).

    Parameters
    ----------
    kv : BudgetedKV or HeadGroups
        The layer's storage (``head_budgets``: its KV heads in groups of their own budgets,
        :class:`~scissorhands.core.layer.heads.HeadGroups`); a cache takes it finished from its plan
        (:meth:`scissorhands.core.planning.assembly.CachePlan.layer`).
    query_tile : int
        Most query rows scored at once.
    layer_idx : int
        The model layer this is.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, kv: BudgetedKV | HeadGroups, query_tile: int = DEFAULTS.query_tile, layer_idx: int = 0):
        self.kv = kv
        super().__init__()
        self.query_tile = query_tile
        self.layer_idx = layer_idx
        self._pending: int | None = None
        self.guard: ModelGuard | None = None  # what the owning cache was built for (set by ScissorhandsCache)
        self.checks_continuation = True  # the cache leaves this to its first budgeted layer: once per forward
        self.reset()

    @classmethod
    def of_budget(cls, budget: int, recent: int, drop: int, state: TokenState | None = None,
                  method: EvictionMethod | None = None, query_tile: int = DEFAULTS.query_tile, layer_idx: int = 0,
                  **options) -> ScissorhandsLayer:
        """A layer built by hand: ``budget``, ``recent`` and ``drop`` (peak tokens stored per sequence, the
        protected recent window, the least number of tokens evicted at once), the method's per-token ``state``,
        the ``method`` (default Scissorhands) and ``options`` (``sinks``, ``merge``, ``prefill``, ``store``, ...:
        see :class:`~scissorhands.core.layer.budgeted.BudgetedKV`), checked by the core layer."""
        return cls(BudgetedKV.checked(budget, recent, drop, method or Scissorhands(), state, layer_idx, **options),
                   query_tile, layer_idx)

    # transformers' base class and callers read `keys`/`values`; they are the store's buffers.
    @property
    def keys(self) -> torch.Tensor | None:
        return getattr(getattr(self.kv, "store", None), "keys", None) if self.kv.allocated else None

    @keys.setter
    def keys(self, value) -> None:  # the base __init__ assigns None; storage belongs to the store
        pass

    @property
    def values(self) -> torch.Tensor | None:
        return getattr(getattr(self.kv, "store", None), "values", None) if self.kv.allocated else None

    @values.setter
    def values(self, value) -> None:
        pass

    @property
    def budget(self) -> int:
        return self.kv.budget

    @property
    def slots(self) -> SlotTable:
        return self.kv.slots

    @property
    def state(self) -> TokenState:
        return self.kv.state

    @property
    def compressions(self) -> int:
        return self.kv.compressions

    # -- transformers layer API ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard.check_keys(key_states, self.layer_idx)
        self.device = key_states.device
        self.kv_dtype = key_states.dtype  # what a continuation must compute in (guard.check_holds)
        self.kv.allocate(key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """Register the new chunk for the attention call that follows; store nothing yet."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if kwargs is None:
            raise ValueError(
                "model: unsupported architecture: its attention does not pass its kwargs to the cache, "
                "so the scissorhands attention cannot be routed"
            )
        if self.checks_continuation and self.kv.allocated:
            check_holds(self.kv.slots, self.kv_dtype, key_states)
            check_continues(self.kv.slots, key_states, kwargs.get("position_ids"))
        if self._pending is not None:
            raise RuntimeError(
                "attention was not routed through scissorhands: call scissorhands.enable(model) "
                "or build the cache with ScissorhandsCache(model, config)"
            )
        self._pending = key_states.shape[-2]
        self.seen += key_states.shape[-2]
        kwargs["scissorhands_layer"] = self
        return key_states, value_states

    def check_model(self, module) -> None:
        """One-line ``ValueError`` if ``module`` belongs to another model (see :class:`.guard.ModelGuard`)."""
        if self.guard is not None:
            self.guard.check_module(module, self.layer_idx)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Stream the chunk handed to :meth:`update` through the budget (:mod:`~scissorhands.core.attend.streaming`)."""
        if self._pending != key.shape[-2]:
            raise RuntimeError("scissorhands attention called without a matching cache update")
        self._pending = None
        if isinstance(self.kv, HeadGroups):
            return self.kv.attend(query, key, value, mask, scaling, softcap, self.query_tile)
        return attend(self.kv, query, key, value, mask, scaling, softcap, self.query_tile)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 0 and self.seen > 0:
            raise ValueError(reuse_message(self.seen))
        # The model's mask covers the new chunk only (causal + padding); stored
        # tokens are masked by the layer itself, since slots are not positions.
        return query_length, self.seen

    def get_seq_length(self) -> int:
        """Tokens seen so far (padding included): the next chunk's offset, not the stored length."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv.reset()
        self.seen = 0
        self._pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ScissorhandsCache cannot roll back: evicted tokens are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.kv.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kv.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.kv.select_batch(torch.arange(self.kv.slots.lengths.numel()).repeat_interleave(repeats))

    # -- reporting -------------------------------------------------------------------------
    def stored_positions(self, row: int) -> torch.Tensor:
        """Positions stored for sequence ``row``, shape (H_kv, stored), in stored order (with head-level budgets,
        -1 pads a head that stores fewer than the most)."""
        if isinstance(self.kv, HeadGroups):
            return self.kv.stored_positions(row)
        self.kv.to_stored_order()
        return self.kv.slots.row(row)

    def held_per_head(self) -> torch.Tensor:
        """Tokens each row stores now (B,), float, averaged over the layer's KV heads."""
        if isinstance(self.kv, HeadGroups):
            return self.kv.held_per_head()
        return self.kv.slots.lengths.double()

    def memory(self) -> dict:
        """Bytes and tokens held by this layer (see :func:`scissorhands.core.layer.footprint.layer_memory`; with
        head-level budgets, :meth:`scissorhands.core.layer.heads.HeadGroups.memory`)."""
        return self.kv.memory() if isinstance(self.kv, HeadGroups) else layer_memory(self.kv)


def _facts(model) -> ModelFacts:
    """The attention facts of a transformers model (or its config); the plan checks that the cache can run them."""
    if not isinstance(getattr(model, "config", model), PretrainedConfig):
        raise ValueError(f"model: must be a transformers model or its config, got {type(model).__name__}")
    return model_facts(model)


def memory_shape(model):
    """What a memory budget's bytes depend on, for this model (see :mod:`scissorhands.core.planning.memory_target`)."""
    from scissorhands.core.planning.memory_target import Shape

    facts = model_facts(model)
    itemsize = next(model.parameters()).element_size()
    config = getattr(model, "config", model)
    return Shape(len(facts.full_layers), facts.num_kv_heads, facts.head_dim, facts.head_dim, itemsize,
                 getattr(config, "model_type", None))


def cache_plan(model, settings: CacheSettings, method: EvictionMethod | None = None, **options) -> CachePlan:
    """:func:`scissorhands.core.planning.assembly.plan` for a transformers model (or its config): its budgeted layers
    and K/V shape filled in; ``options`` are the plan's (``protection``, ``protect_name``, ``budget``, ``memory``,
    ``length``). :meth:`ScissorhandsCache.from_plan` builds the cache it plans."""
    facts = _facts(model)
    shape = memory_shape(model) if options.get("memory") is not None else None  # reads the weights' dtype
    return plan(settings, len(facts.full_layers), method or Scissorhands(), shape=shape, facts=facts, **options)


class ScissorhandsCache(Cache):
    """A drop-in ``cache=`` for ``model.generate`` that evicts by persistence of importance.

    Full-attention layers become :class:`ScissorhandsLayer` with a per-layer budget
    from the schedule; sliding-window and chunked layers keep transformers' own
    layers and their native window.

    Parameters
    ----------
    model : PreTrainedModel or PretrainedConfig
        The model, or just its config if the caller switches the attention itself. Given a model, the cache
        switches its attention to the scissorhands function (:class:`scissorhands.enable`; layers without a
        scissorhands cache still run plain SDPA) and keeps the switch as :attr:`attention`:
        ``cache.attention.restore()`` puts the model's own implementation back. To scope the switch to a
        block, build the cache inside ``with scissorhands.enable(model):``.
    config : ScissorhandsConfig
        Budget, windows, drop amount, importance form and schedule.
    method : EvictionMethod, optional
        Scoring rule (see :mod:`scissorhands.core.methods`); default Scissorhands.
    protect : list of (start, end), or one such list per sequence, optional
        Token spans never evicted in any layer (see :mod:`scissorhands.core.tokens.protect`);
        they count against the budget, and a protection that leaves a layer
        no room to evict is refused.
    audit : EvictionAudit, optional
        Records every eviction (see :mod:`scissorhands.core.layer.audit`).

    Examples
    --------
    >>> cache = ScissorhandsCache(model, ScissorhandsConfig(budget=400))
    >>> out = model.generate(**inputs, cache=cache, max_new_tokens=100)
    >>> cache.memory_report()["peak_stored"] <= 400
    True
    """

    #: What ``for_memory`` chose (None for a cache built from a token budget).
    memory_choice: MemoryChoice | None = None
    #: The switch of the model's attention this cache made (None when built from a config); ``.restore()``.
    attention: enable | None = None

    def __init__(self, model, config: ScissorhandsConfig, method: EvictionMethod | None = None, *,
                 protect: SpanSpec | Protection | None = None, audit: EvictionAudit | None = None,
                 protect_name: str = "protect"):
        if not isinstance(config, ScissorhandsConfig):
            raise ValueError(f"config: must be a ScissorhandsConfig, got {type(config).__name__}")
        if method is not None and not isinstance(method, EvictionMethod):
            raise ValueError(f"method: must be an EvictionMethod instance, got {method!r}")
        protection = Protection.parse(protect)
        facts = _facts(model)
        self._build(model, plan(config, len(facts.full_layers), method or Scissorhands(), protection=protection,
                                protect_name=protect_name, facts=facts), audit, facts)

    def _build(self, model, made: CachePlan, audit: EvictionAudit | None, facts: ModelFacts) -> None:
        """The cache of a plan: the model's attention switched, each budgeted layer as the plan hands it out."""
        if audit is not None and not isinstance(audit, EvictionAudit):
            raise ValueError(f"audit: must be an EvictionAudit, got {type(audit).__name__}")
        config = made.config
        if audit is not None and config.decode != "dynamic":
            raise ValueError(f"decode: {config.decode!r} cannot tell an audit of each eviction without reading the "
                             "device; use decode='dynamic' with an audit")
        if hasattr(model, "set_attn_implementation"):
            self.attention = enable(model)
        self.plan = made  # what it was built from: its layers, and their bytes (CachePlan.kv_bytes)
        self.method = made.method
        self.config = config
        self.facts = facts
        self.protection = made.protection
        self.audit = audit
        self.memory_choice = made.memory_choice
        guard = ModelGuard(facts)
        layers: list = []
        budgeted = {idx: i for i, idx in enumerate(facts.full_layers)}  # the plan's layers, one per full layer
        for idx, (layer_type, kwargs) in enumerate(zip(facts.layer_types, facts.layer_kwargs)):
            if layer_type != FULL:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
                continue
            # The plan's finished layer (with head-level budgets, its groups of KV heads, each a layer of its own).
            layer = ScissorhandsLayer(made.layer(budgeted[idx], idx), config.query_tile, idx)
            if audit is not None:
                if isinstance(layer.kv, HeadGroups):
                    layer.kv.listen(audit)
                else:
                    layer.kv.listeners.append(audit)
                audit.attach(idx)
            layer.guard = guard
            layer.checks_continuation = not any(isinstance(x, ScissorhandsLayer) for x in layers)
            layers.append(layer)
        super().__init__(layers=layers)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' per-layer update; a layer index this cache does not have is a one-line ``ValueError``."""
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"model: this ScissorhandsCache was built for a model with {len(self.layers)} layers, "
                             f"but is used with one that has a layer {layer_idx}; build one cache per model")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def budgeted_layers(self) -> list[ScissorhandsLayer]:
        return [layer for layer in self.layers if isinstance(layer, ScissorhandsLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Sliding layers count the same tokens; read a budgeted layer for a uniform answer.
        layers = self.budgeted_layers
        return layers[0].seen if layers else super().get_seq_length(layer_idx)

    @classmethod
    def from_plan(cls, model, made: CachePlan, *, audit: EvictionAudit | None = None) -> ScissorhandsCache:
        """The cache a plan made for this model (:func:`cache_plan`) describes: its layers as the plan hands them
        out, its protection and what a memory target chose; nothing planned again."""
        if not isinstance(made, CachePlan):
            raise ValueError(f"plan: must be a CachePlan (see cache_plan), got {type(made).__name__}")
        facts = _facts(model)
        if made.facts != facts:  # the plan checked its model's facts (supported, its layers, their centres)
            raise ValueError("plan: made for another model (or by layer count alone); plan for this model with "
                             "cache_plan(model, ...)")
        cache = cls.__new__(cls)
        cache._build(model, made, audit, facts)
        return cache

    @classmethod
    def build(cls, model, config: ScissorhandsConfig | CachePlan, method: EvictionMethod | None = None, *,
              protect: SpanSpec | Protection | None = None, audit: EvictionAudit | None = None,
              protect_name: str = "protect") -> ScissorhandsCache:
        """The cache of a plan (:meth:`from_plan`; it holds its method and protected spans) or of a configuration
        (the constructor)."""
        if not isinstance(config, CachePlan):
            return cls(model, config, method, protect=protect, audit=audit, protect_name=protect_name)
        if method is not None or protect is not None:
            given = "method" if method is not None else protect_name
            raise ValueError(f"{given}: a plan holds its method and protected spans; give them to the plan")
        return cls.from_plan(model, config, audit=audit)

    @classmethod
    def for_memory(cls, model, memory, length: int, settings: CacheSettings | None = None,
                   method: EvictionMethod | None = None, *, protect: SpanSpec | Protection | None = None,
                   audit: EvictionAudit | None = None, protect_name: str = "protect") -> ScissorhandsCache:
        """A cache whose peak bytes fit ``memory`` for a sequence of ``length`` tokens (prompt + new tokens).

        ``memory`` is a fraction of the full cache's K/V bytes (``0.2``: a fifth) or a size per sequence
        (``"64MiB"``); the store and token budget are chosen by :func:`scissorhands.core.planning.memory_target.choose`
        and kept as ``cache.memory_choice`` (also in :meth:`memory_report`). Other arguments are the
        constructor's.
        """
        made = cache_plan(model, settings if settings is not None else CacheSettings(), method,
                          protection=Protection.parse(protect), memory=memory, length=length,
                          protect_name=protect_name)
        return cls.from_plan(model, made, audit=audit)

    def memory_report(self) -> dict:
        """K/V, per-token state and position bytes, and tokens stored.

        See :func:`scissorhands.hf.report.cache_memory_report`; with ``memory=``, what it chose is
        under ``"memory_choice"``.
        """
        report = cache_memory_report(self)
        if self.memory_choice is not None:
            report["memory_choice"] = self.memory_choice.record()
        return report
