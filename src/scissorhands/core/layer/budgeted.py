"""One layer's budgeted K/V: storage, slot bookkeeping, per-token state and eviction, without transformers.

:class:`BudgetedKV` owns four parts and keeps them aligned: the K/V store
(:mod:`..stores`), the slot table (:mod:`..tokens.slots`), the method's per-token state
(:mod:`..tokens.state`), and the method that scores tokens (:mod:`..methods`). Appending
writes all of them; an eviction asks the method for scores, picks the kept
slots with :func:`~scissorhands.core.tokens.selection.keep_order`, and compacts all of
them with the same index. The attention that feeds it lives in :mod:`..attend.streaming`.

Two extension points let features join an eviction without editing it:

* ``shields``: objects with ``mask(positions) -> bool`` (slots never to
  drop), ``select_batch(index)`` and ``for_batch(batch)`` (the shield for a
  batch of that many rows, expanded for beams or refused); attention sinks and
  protected spans are shields (:class:`~scissorhands.core.tokens.protect.Protection`);
* ``listeners``: objects told of every eviction, ``evicted_tokens(layer_idx,
  seen, positions, scores, dropped)``, and of row reordering,
  ``select_batch(layer_idx, index)``; the eviction audit is one
  (:class:`~scissorhands.core.layer.audit.EvictionAudit`).

Tiers (demotion before eviction), when the store keeps a chain of bit widths
(:class:`~scissorhands.core.stores.tiered.TieredKVStore`, ``kv_demote``):

* a new token is stored at the widest width; each width ``w`` above the base
  may hold at most ``cap_w`` tokens of a row (that width or wider);
* a compression event comes when the next token would exceed the budget *or*
  a width's cap. It first evicts (if the row is at its budget) ``drop`` tokens
  among those at the base width: a token at a wider width is evicted only if
  no base token is left outside the recent window and the shields. Then, at
  every width whose cap is reached, widest pool first, it demotes the
  ``drop`` lowest-scoring tokens at exactly that width to the next width down
  (a wider token only when none at that width is left). Every width then fills
  in step with the others and with the budget, so a chain adds no events: one
  per ``drop`` tokens, as without tiers. The recent window is never demoted;
  shielded tokens only when no other token is left. Ties go as for eviction:
  the older token first. Both use the scores the method gave at the start of
  the event.
"""

from __future__ import annotations

import torch

from ..methods.base import EvictionMethod, LayerView
from ..settings.storage import check_demotion, check_residual
from ..stores.base import DenseKVStore, KVStore
from ..tokens.merging import MergeState
from ..tokens.protect import Protection
from ..tokens.rounds import RoundState
from ..tokens.slots import SlotTable
from ..tokens.state import TokenState
from .append import Appending
from .decode import make_decode
from .demotion import Demotion
from .eviction import Eviction


class BudgetedKV:
    """At most ``budget`` tokens per row and KV head, evicted ``drop`` at a time by ``method``.

    A plan hands its layers out built (:meth:`..planning.assembly.CachePlan.layer`), their parts checked once
    there; a layer built by hand is checked by :meth:`checked`.

    Parameters
    ----------
    budget : int
        Most tokens stored per sequence at any instant.
    recent : int
        Number of most recently appended tokens that are never evicted.
    drop : int
        Least number of tokens evicted at one compression.
    method : EvictionMethod
        Scores stored tokens; the selection is done here.
    state : TokenState, optional
        The method's per-token state (from ``method.make_state``).
    layer_idx : int
        The model layer this is, so methods can tell layers apart.
    store : KVStore, optional
        Where K/V live (default: dense, in the model's dtype).
    sinks : int
        The first ``sinks`` positions of a sequence are never evicted (a protected span).
    protect : Protection, optional
        Further spans never evicted.
    merge : bool
        Fold evicted tokens into their nearest kept token (see :mod:`..tokens.merging`).
    prefill : scissorhands.core.attend.prefill.Prefill, optional
        How a chunk of new tokens is taken (:mod:`..attend.prefill`; default streamed).
    decode : {"dynamic", "static", "compiled"}
        How a decode step runs: compact slots planned on the host (``dynamic``), or fixed shapes with no
        host synchronisation, eager or under ``torch.compile`` (:mod:`.decode`).
    rounds : bool
        Evict in rounds (:mod:`..tokens.rounds`): a full row chooses ``drop`` victims at once, and each new token
        evicts the oldest of them.
    """

    def __init__(self, budget: int, recent: int, drop: int, method: EvictionMethod,
                 state: TokenState | None = None, layer_idx: int = 0, store: KVStore | None = None, *,
                 sinks: int = 0, merge: bool = False, prefill=None,
                 protect: Protection | None = None, decode: str = "dynamic", rounds: bool = False):
        self.budget, self.recent, self.drop = budget, recent, drop
        self.prefill = prefill  # None: streamed (see :func:`..attend.streaming.attend`)
        self.method = method
        self.state = state if state is not None else TokenState()
        self.layer_idx = layer_idx
        self.store: KVStore = store if store is not None else DenseKVStore()
        self.merge = MergeState() if merge else None
        # Every per-token state kept beside K/V: the method's, and the merge masses if merging.
        self.states: list[TokenState] = [self.state] if self.merge is None else [self.state, self.merge]
        self.shields: list = [] if not sinks else [Protection.prefix(sinks)]
        if protect is not None:
            self.shields.append(protect)
        self.given_shields = list(self.shields)  # as given; each allocation fits them to its batch
        self.held: torch.Tensor | None = None  # (B,) prompt tokens kept beside the budget (hold), or None
        self.held_first = 0  # held[0] as a Python int, for the aligned decode step (no tensor read per token)
        self.listeners: list = []
        self.tiers = self.store.tiered()  # the chain of widths, or None
        self.demotion = None if self.tiers is None else Demotion(self.tiers)
        if self.tiers is not None:
            self.tiers.bind(budget, recent, drop)
        self.static = make_decode(self, decode)
        self.rounds: RoundState | None = None
        if rounds:
            self.rounds = RoundState()
            self.states.append(self.rounds)
        self.eviction = Eviction(self)
        self.appending = Appending(self)
        self.reset()

    @classmethod
    def checked(cls, budget: int, recent: int, drop: int, method: EvictionMethod, state: TokenState | None = None,
                layer_idx: int = 0, store: KVStore | None = None, **options) -> BudgetedKV:
        """A layer built by hand, its arguments checked as the plan checks a planned layer's (the constructor takes
        the parts :meth:`..planning.assembly.CachePlan.layer` hands it as they are)."""
        return _check_parts(cls(budget, recent, drop, method, state, layer_idx, store, **options))

    # -- a compression event (:class:`.eviction.Eviction`, a part of the layer) -------------------------------
    def view(self, prompt_attention: torch.Tensor | None = None) -> LayerView:
        """The read-only view a method scores (``prompt_attention``: see :class:`..attend.prefill.PromptAware`)."""
        return self.eviction.view(prompt_attention)

    def compress(self, rows: torch.Tensor, drop: int | None = None) -> None:
        """Evict ``drop`` (default: the layer's) tokens from each KV head of the rows ``rows`` (CPU bool, (B,))."""
        self.eviction.compress(rows, drop)

    def evict(self, scores: torch.Tensor, n_drop: torch.Tensor) -> torch.Tensor:
        """Drop the ``n_drop`` (B,) lowest ``scores`` (B, H_kv, L) of each row and KV head, and compact; the order
        the slots were compacted by (B, H_kv, L), kept slots first."""
        return self.eviction.evict(scores, n_drop)

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage shaped after a first chunk (B, H_kv, T, D)."""
        b, h = key.shape[:2]
        if self.static is not None:
            self.static.active = False
        self.shields = [shield.for_batch(b) for shield in self.given_shields]
        self.held, self.held_first = None, 0
        self.store.allocate(key, value)
        self.slots = SlotTable(b, h, key.device)
        self.compressions = 0
        self.allocated = True
        self.states_ready = False  # the states allocate at the first attention (they need the group size)
        if self.demotion is not None:
            self.demotion.allocate(b)

    def reset(self) -> None:
        """Forget the sequence: storage, state and slots start empty (nothing allocated)."""
        if self.static is not None:
            self.static.active = False
        self.store.reset()
        for state in self.states:
            state.reset()
        self.slots = SlotTable(0, 0, None)
        self.shields = list(self.given_shields)
        self.held, self.held_first = None, 0
        self.compressions = 0
        self.allocated = False
        self.states_ready = False
        if self.demotion is not None:
            self.demotion.reset()

    def to_stored_order(self) -> None:
        """Slots back in stored order after static decode steps (see :mod:`.decode`); a no-op otherwise."""
        if self.static is not None:
            self.static.settle()

    def room(self) -> torch.Tensor:
        """Tokens each row (B,) can take before its next compression event (CPU): the budget's free slots (beside
        a kept prompt, :meth:`hold`), and with tiers the free entries of every width."""
        free = self.budget - self.slots.lengths
        if self.held is not None:
            free = free + self.held
        return free if self.demotion is None else self.demotion.room(free)

    def room_uniform(self) -> int:
        """:meth:`room` when every row is aligned, as one integer (no tensor operation without tiers). Aligned rows
        saw prompts of one length, so they keep equal prompts beside the budget."""
        free = self.budget + self.held_first - self.slots.uniform_state()[0]
        return free if self.demotion is None else self.demotion.room_uniform(free)

    def hold(self, kept: torch.Tensor, prompt: torch.Tensor) -> None:
        """Keep each row's first ``prompt`` (B,) positions, ``kept`` (B,) of them stored, beside the budget until
        the sequence ends (``prefill="keep-prompt"``): they are shielded from every later eviction, and the
        budget holds the tokens after them. Called once, after the prompt is stored."""
        self.held = kept.to(self.slots.lengths.device, self.slots.lengths.dtype).clone()
        self.held_first = int(self.held[0])
        self.shields.append(Protection([[(0, int(n))] if int(n) > 0 else [] for n in prompt.tolist()]))

    @property
    def capacity(self) -> int:
        return self.store.capacity

    def reserve(self, needed: int, limit: int | None = None) -> None:
        """Grow every part (geometrically, never past ``limit``, by default the budget) to hold ``needed`` slots."""
        cap = self.capacity
        if needed <= cap:
            return
        most = self.budget if self.held is None else self.budget + int(self.held.max())
        self.resize(min(limit or most, max(needed, 2 * cap, 16)))

    def resize(self, capacity: int) -> None:
        """Set every part's slot axis to ``capacity``."""
        self.store.resize(capacity)
        self.slots.resize(capacity)
        for state in self.states:
            state.resize(capacity)

    def append(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, cum: torch.Tensor) -> None:
        """Write each row's real tokens of a block after its stored ones (:meth:`.append.Appending.block`)."""
        self.appending.block(key, value, valid, cum)

    def append_token(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """Decode fast path: one token per row, all rows aligned; return the new stored length."""
        return self.appending.token(key, value)

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (beam reordering, batch expansion)."""
        if not self.allocated:
            return
        self.to_stored_order()
        dev = index.to(self.slots.device)
        self.shields = [shield.select_batch(index) for shield in self.shields]
        if self.held is not None:
            self.held = self.held[index.to(self.held.device)]
            self.held_first = int(self.held[0])
        for listener in self.listeners:
            listener.select_batch(self.layer_idx, index)
        self.store.select_batch(dev)
        for state in self.states:
            state.select_batch(dev)
        self.slots.select_batch(index)
        if self.demotion is not None:
            self.demotion.select_batch(index)


def _check_parts(layer: BudgetedKV) -> BudgetedKV:
    """:meth:`BudgetedKV.checked`'s rules (the plan's, for a layer built by hand); one-line ``ValueError``s naming
    the parameter."""
    budget, recent, drop, evicts = layer.budget, layer.recent, layer.drop, not layer.method.is_full
    if drop > budget - recent:
        raise ValueError(f"drop: must be <= budget - recent ({budget - recent}) for this layer, got {drop}")
    check_residual(layer.store.residual, recent, merge=layer.merge is not None, evicts=evicts)
    if layer.tiers is not None:
        check_demotion(merge=layer.merge is not None, evicts=evicts)
    if layer.rounds is not None and (layer.merge is not None or layer.tiers is not None or layer.static is not None):
        raise ValueError("rounds: cannot be combined with merge, kv_demote or a static decode")
    return layer
