"""One layer's budgeted K/V: storage, slot bookkeeping, per-token state and eviction, without transformers.

:class:`BudgetedKV` owns four parts and keeps them aligned: the K/V store
(:mod:`.kvstore`), the slot table (:mod:`.slots`), the method's per-token state
(:mod:`.state`), and the method that scores tokens (:mod:`.methods`). Appending
writes all of them; an eviction asks the method for scores, picks the kept
slots with :func:`~scissorhands.core.selection.keep_order`, and compacts all of
them with the same index. The attention that feeds it lives in :mod:`.streaming`.

Two extension points let features join an eviction without editing it:

* ``shields``: objects with ``mask(positions) -> bool`` (slots never to
  drop), ``select_batch(index)`` and ``for_batch(batch)`` (the shield for a
  batch of that many rows, expanded for beams or refused); attention sinks and
  protected spans are shields (:class:`~scissorhands.core.protect.Protection`);
* ``listeners``: objects told of every eviction, ``evicted_tokens(layer_idx,
  seen, positions, scores, dropped)``, and of row reordering,
  ``select_batch(layer_idx, index)``; the eviction audit is one
  (:class:`~scissorhands.core.audit.EvictionAudit`).
"""

from __future__ import annotations

import torch

from .merging import MergeState
from .methods.base import EvictionMethod, LayerView
from .protect import Protection
from .selection import keep_order
from .slots import SlotTable
from .state import TokenState
from .stores.base import DenseKVStore, KVStore


def _whole_batch(keep: torch.Tensor, sel: torch.Tensor, batch: int) -> torch.Tensor:
    """``keep`` (len(sel), H_kv, L) widened to every row, the identity order elsewhere."""
    b, h, length = batch, keep.shape[1], keep.shape[2]
    order = torch.arange(length, device=keep.device).expand(b, h, length).clone()
    return order.index_copy_(0, sel, keep)


class BudgetedKV:
    """At most ``budget`` tokens per row and KV head, evicted ``drop`` at a time by ``method``.

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
        Fold evicted tokens into their nearest kept token (see :mod:`.merging`).
    prefill : scissorhands.core.prefill.Prefill, optional
        How a chunk of new tokens is taken (:mod:`.prefill`; default streamed).
    """

    def __init__(self, budget: int, recent: int, drop: int, method: EvictionMethod,
                 state: TokenState | None = None, layer_idx: int = 0, store: KVStore | None = None, *,
                 sinks: int = 0, merge: bool = False, prefill=None,
                 protect: Protection | None = None):
        if drop > budget - recent:
            raise ValueError(f"drop: must be <= budget - recent ({budget - recent}) for this layer, got {drop}")
        residual = store.residual if store is not None else 0
        if residual and not method.is_full and residual > recent:
            raise ValueError(f"kv_residual: must be <= the recent window ({recent}) for this layer, got {residual}")
        if residual and merge:
            raise ValueError("kv_residual: cannot be combined with merge")
        self.budget, self.recent, self.drop = budget, recent, drop
        self.prefill = prefill  # None: streamed (see :func:`.streaming.attend`)
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
        self.listeners: list = []
        self.reset()

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage shaped after a first chunk (B, H_kv, T, D)."""
        b, h = key.shape[:2]
        self.shields = [shield.for_batch(b) for shield in self.given_shields]
        self.store.allocate(key, value)
        self.slots = SlotTable(b, h, key.device)
        self.compressions = 0
        self.allocated = True
        self.states_ready = False  # the states allocate at the first attention (they need the group size)

    def reset(self) -> None:
        """Forget the sequence: storage, state and slots start empty (nothing allocated)."""
        self.store.reset()
        for state in self.states:
            state.reset()
        self.slots = SlotTable(0, 0, None)
        self.compressions = 0
        self.allocated = False
        self.states_ready = False

    @property
    def capacity(self) -> int:
        return self.store.capacity

    def reserve(self, needed: int, limit: int | None = None) -> None:
        """Grow every part (geometrically, never past ``limit``, by default the budget) to hold ``needed`` slots."""
        cap = self.capacity
        if needed <= cap:
            return
        self.resize(min(limit or self.budget, max(needed, 2 * cap, 16)))

    def resize(self, capacity: int) -> None:
        """Set every part's slot axis to ``capacity``."""
        self.store.resize(capacity)
        self.slots.resize(capacity)
        for state in self.states:
            state.resize(capacity)

    def append(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, cum: torch.Tensor) -> None:
        """Write each row's real tokens of a block after its stored ones.

        key, value : (B, H_kv, c, D); valid : (B, c) bool or None (all real);
        cum : (B, c) CPU, real tokens of the block up to and including each index.
        """
        slots = self.slots
        added = cum[:, -1]  # (B,)
        self.reserve(int((slots.lengths + added).max()))
        if valid is None and slots.aligned(slots.lengths):
            start, c = int(slots.lengths[0]), key.shape[-2]
            self.store.write(start, key, value)
            slots.place_block(start, c)
            for state in self.states:
                state.clear(start, start + c)
        else:
            rows, cols = (valid if valid is not None else torch.ones_like(cum, dtype=torch.bool)).nonzero(as_tuple=True)
            where = slots.place_tokens(rows, cum, cols)
            r, sl, cl = rows.to(slots.device), where.to(slots.device), cols.to(slots.device)
            self.store.write_at(r, sl, key[r, :, cl], value[r, :, cl])  # (N, H_kv, D) each
            for state in self.states:
                state.clear_slots(r, sl)
        slots.advance(added)

    def append_token(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """Decode fast path: one token per row, all rows aligned; return the new stored length."""
        slots = self.slots
        length, seen = slots.uniform  # type: ignore[misc]  # the caller checked that rows are aligned
        if length + 1 > self.capacity:
            self.reserve(length + 1)
        self.store.write(length, key, value)
        slots.positions[:, :, length] = seen
        for state in self.states:
            state.clear(length, length + 1)
        slots.advance_uniform()
        return length + 1

    def view(self, prompt_attention: torch.Tensor | None = None) -> LayerView:
        """The read-only view a method scores (``prompt_attention``: see :class:`.prefill.PromptAware`)."""
        return LayerView(self.layer_idx, self.slots.length, self.compressions, self.state, self.slots,
                         self.store.read, prompt_attention)

    def compress(self, rows: torch.Tensor, drop: int | None = None) -> None:
        """Evict ``drop`` (default: the layer's) tokens from each KV head of the rows ``rows`` (CPU bool, (B,))."""
        n_drop = torch.where(rows, self.drop if drop is None else drop, 0)  # (B,)
        self.evict(self.method.score(self.view()), n_drop)

    def evict(self, scores: torch.Tensor, n_drop: torch.Tensor) -> None:
        """Drop the ``n_drop`` (B,) lowest ``scores`` (B, H_kv, L) of each row and KV head, and compact."""
        length = scores.shape[-1]
        positions = self.slots.positions[:, :, :length]  # (B, H_kv, L)
        shield = None
        for part in self.shields:
            mask = part.mask(positions)
            shield = mask if shield is None else shield | mask
        # Only the rows that drop tokens are ranked and compacted (a ragged batch compresses its rows at
        # different steps); merging folds across every row's slots, so it takes the whole batch.
        dropping = n_drop > 0
        rows = None if self.merge is not None or bool(dropping.all()) else dropping.nonzero().squeeze(1)
        sel = None if rows is None else rows.to(scores.device)
        if sel is None:
            keep = keep_order(scores, self.slots.lengths, self.recent, n_drop, shield)
        else:
            sub_shield = None if shield is None else shield.expand_as(scores)[sel]
            keep = keep_order(scores[sel], self.slots.lengths[rows], self.recent, n_drop[rows], sub_shield)
        if self.listeners:
            # Slot keep[b, h, j] is dropped when its rank j is among the last n_drop[b].
            rank = torch.arange(length, device=keep.device)
            sub_drop = n_drop if rows is None else n_drop[rows]
            last = rank[None, None, :] >= (length - sub_drop.to(keep.device))[:, None, None]  # (B', 1, L)
            dropped = torch.zeros_like(keep, dtype=torch.bool).scatter_(2, keep, last.expand_as(keep))
            if sel is not None:
                dropped = torch.zeros_like(scores, dtype=torch.bool).index_copy_(0, sel, dropped)  # (B, H_kv, L)
            for listener in self.listeners:
                listener.evicted_tokens(self.layer_idx, self.slots.seen, positions, scores, dropped)
        if self.merge is not None:
            keys, values = self.store.read(length)
            self.store.write(0, keys, self.merge.fold(keys, values, keep, self.slots.lengths, n_drop))
        self.store.reorder(keep, sel)
        whole = None
        for state in self.states:
            if sel is None:
                state.compact(keep)
            elif state.compacts_rows:
                state.compact(keep, sel)
            else:  # a state that compacts whole batches only (it says so): the identity order in other rows
                whole = _whole_batch(keep, sel, scores.shape[0]) if whole is None else whole
                state.compact(whole)
        self.slots.compact(keep, n_drop, sel)
        self.compressions += 1

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (beam reordering, batch expansion)."""
        if not self.allocated:
            return
        dev = index.to(self.slots.device)
        self.shields = [shield.select_batch(index) for shield in self.shields]
        for listener in self.listeners:
            listener.select_batch(self.layer_idx, index)
        self.store.select_batch(dev)
        for state in self.states:
            state.select_batch(dev)
        self.slots.select_batch(index)
