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
  ``drop`` lowest-scoring tokens at that width or wider to the next width
  down. The recent window is never demoted; shielded tokens only when no other
  token is left. Ties go as for eviction: the older token first. Both use the
  scores the method gave at the start of the event.
"""

from __future__ import annotations

import torch

from ..methods.base import EvictionMethod, LayerView
from ..stores.base import DenseKVStore, KVStore
from ..stores.settings import check_demotion, check_residual
from ..tokens.merging import MergeState
from ..tokens.protect import Protection
from ..tokens.rounds import RoundState
from ..tokens.selection import keep_order, lowest
from ..tokens.slots import SlotTable
from ..tokens.state import TokenState
from .decode import make_decode


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
        if drop > budget - recent:
            raise ValueError(f"drop: must be <= budget - recent ({budget - recent}) for this layer, got {drop}")
        residual = store.residual if store is not None else 0
        check_residual(residual, recent, merge=merge, evicts=not method.is_full)
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
        self.listeners: list = []
        self.tiers = self.store.tiered()  # the chain of widths, or None
        if self.tiers is not None:
            check_demotion(merge=merge, evicts=not method.is_full)
            self.tiers.bind(budget, recent, drop)
        self.static = make_decode(self, decode)
        self.rounds: RoundState | None = None
        if rounds:
            if self.merge is not None or self.tiers is not None or self.static is not None:
                raise ValueError("rounds: cannot be combined with merge, kv_demote or a static decode")
            self.rounds = RoundState()
            self.states.append(self.rounds)
        self.reset()

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage shaped after a first chunk (B, H_kv, T, D)."""
        b, h = key.shape[:2]
        if self.static is not None:
            self.static.active = False
        self.shields = [shield.for_batch(b) for shield in self.given_shields]
        self.store.allocate(key, value)
        self.slots = SlotTable(b, h, key.device)
        self.compressions = 0
        self.allocated = True
        self.states_ready = False  # the states allocate at the first attention (they need the group size)
        self.tier_counts = torch.zeros(b, 0 if self.tiers is None else len(self.tiers.tier_caps), dtype=torch.long)

    def reset(self) -> None:
        """Forget the sequence: storage, state and slots start empty (nothing allocated)."""
        if self.static is not None:
            self.static.active = False
        self.store.reset()
        for state in self.states:
            state.reset()
        self.slots = SlotTable(0, 0, None)
        self.compressions = 0
        self.allocated = False
        self.states_ready = False
        self.tier_counts = torch.zeros(0, 0, dtype=torch.long)  # (B, widths above the base), CPU

    def to_stored_order(self) -> None:
        """Slots back in stored order after static decode steps (see :mod:`.decode`); a no-op otherwise."""
        if self.static is not None:
            self.static.settle()

    def room(self) -> torch.Tensor:
        """Tokens each row (B,) can take before its next compression event (CPU): the budget's free slots, and
        with tiers the free entries of every width."""
        free = self.budget - self.slots.lengths
        if self.tiers is None:
            return free
        caps = torch.tensor(self.tiers.tier_caps)
        return torch.minimum(free, (caps[None, :] - self.tier_counts).min(dim=1).values)

    def room_uniform(self) -> int:
        """:meth:`room` when every row is aligned, as one integer (no tensor operation without tiers)."""
        free = self.budget - self.slots.uniform_state()[0]
        if self.tiers is None:
            return free
        # Rows of equal length may differ in their widths' counts: the fullest decides (an event is a no-op for a
        # row with room left, since it evicts only at the budget and demotes only at a full width).
        return min(free, min(c - int(n) for c, n in zip(self.tiers.tier_caps, self.tier_counts.amax(dim=0))))

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
        if self.tiers is not None:
            self.tier_counts += added[:, None]

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
        if self.tiers is not None:
            self.tier_counts += 1
        return length + 1

    def view(self, prompt_attention: torch.Tensor | None = None) -> LayerView:
        """The read-only view a method scores (``prompt_attention``: see :class:`..attend.prefill.PromptAware`)."""
        return LayerView(self.layer_idx, self.slots.length, self.compressions, self.state, self.slots,
                         self.store.read, prompt_attention)

    def compress(self, rows: torch.Tensor, drop: int | None = None) -> None:
        """Evict ``drop`` (default: the layer's) tokens from each KV head of the rows ``rows`` (CPU bool, (B,)).

        With tiers, a row evicts only if it is at its budget, and demotes at every width whose cap it reached.
        """
        amount = self.drop if drop is None else drop
        if self.rounds is not None:
            self._round(rows, amount)
            return
        if self.tiers is None:
            self.evict(self.method.score(self.view()), torch.where(rows, amount, 0))
            return
        scores = self.method.score(self.view())
        n_drop = torch.where(rows & (self.slots.lengths >= self.budget), amount, 0)
        if bool((n_drop > 0).any()):
            order = self.evict(scores, n_drop)
            scores = scores.gather(2, order.to(scores.device))[:, :, : self.slots.length]
        self._demote(scores, rows, amount)

    def _round(self, rows: torch.Tensor, amount: int) -> None:
        """Rows ``rows`` with no victim pending choose ``amount``; then each of ``rows`` drops its oldest victim."""
        assert self.rounds is not None
        lengths = self.slots.lengths
        start = rows & (self.rounds.pending(lengths) == 0)
        if bool(start.any()):
            scores = self.method.score(self.view())
            shield = self._shield(self.slots.positions[:, :, : self.slots.length])
            self.rounds.choose(lowest(scores, lengths, self.recent, torch.where(start, amount, 0), shield))
        self.evict(self.rounds.next_out(lengths), torch.where(rows, 1, 0))

    def _demote(self, scores: torch.Tensor, rows: torch.Tensor, amount: int) -> None:
        """At each width whose cap a row of ``rows`` reached, demote its ``amount`` lowest ``scores`` a width down."""
        tiers = self.tiers
        assert tiers is not None
        length = scores.shape[-1]
        device = scores.device
        counts = tiers.head_counts()  # (B, H_kv, levels): after the eviction
        rows_d = rows.to(device)[:, None]
        recent = torch.clamp(self.slots.lengths, max=self.recent).to(device)[:, None]  # (B, 1)
        shield = self._shield(self.slots.positions[:, :, :length])
        # Shielded tokens go only when nothing else is left: above every score, below the recent window.
        ranked = scores if shield is None else scores.masked_fill(shield, torch.finfo(scores.dtype).max)
        for level in reversed(range(len(tiers.tier_caps))):  # the widest pool first
            # Each KV head demotes at a width only when its own count there reached the cap.
            full = rows_d & (counts[..., level] >= tiers.tier_caps[level])  # (B, H_kv)
            if not bool(full.any()):
                continue
            holds = tiers.pools[level].where[:, :, :length] >= 0  # (B, H_kv, L): at this width or wider
            n = torch.where(full, torch.clamp(counts[..., level] - recent, max=amount), 0)
            tiers.demote(level, lowest(ranked, self.slots.lengths, self.recent, n, ~holds) & holds)
            counts = tiers.head_counts()
        self.tier_counts = counts.amax(dim=1).cpu()

    def _shield(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Slots (B, H_kv, L) no eviction may drop: every shield's mask, or'ed."""
        shield = None
        for part in self.shields:
            mask = part.mask(positions)
            shield = mask if shield is None else shield | mask
        return shield

    def evict(self, scores: torch.Tensor, n_drop: torch.Tensor) -> torch.Tensor:
        """Drop the ``n_drop`` (B,) lowest ``scores`` (B, H_kv, L) of each row and KV head, and compact.

        Returns the order the slots were compacted by, over every row (B, H_kv, L): kept slots first.
        """
        length = scores.shape[-1]
        positions = self.slots.positions[:, :, :length]  # (B, H_kv, L)
        shield = self._shield(positions)
        ranked = scores
        if self.tiers is not None:
            # Only tokens at the base width are evicted while any is left: wider ones rank above every score.
            ranked = scores.masked_fill(self.tiers.tier_mask(length), torch.finfo(scores.dtype).max)
        # Only the rows that drop tokens are ranked and compacted (a ragged batch compresses its rows at
        # different steps); merging folds across every row's slots, so it takes the whole batch.
        dropping = n_drop > 0
        rows = None if self.merge is not None or bool(dropping.all()) else dropping.nonzero().squeeze(1)
        sel = None if rows is None else rows.to(scores.device)
        if sel is None:
            keep = keep_order(ranked, self.slots.lengths, self.recent, n_drop, shield)
        else:
            sub_shield = None if shield is None else shield.expand_as(scores)[sel]
            keep = keep_order(ranked[sel], self.slots.lengths[rows], self.recent, n_drop[rows], sub_shield)
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
        if self.tiers is not None:
            self.tiers.forget(self.slots.lengths)
        return keep if sel is None else _whole_batch(keep, sel, scores.shape[0])

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (beam reordering, batch expansion)."""
        if not self.allocated:
            return
        self.to_stored_order()
        dev = index.to(self.slots.device)
        self.shields = [shield.select_batch(index) for shield in self.shields]
        for listener in self.listeners:
            listener.select_batch(self.layer_idx, index)
        self.store.select_batch(dev)
        for state in self.states:
            state.select_batch(dev)
        self.slots.select_batch(index)
        self.tier_counts = self.tier_counts.index_select(0, index.cpu())
