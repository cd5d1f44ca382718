"""One compression event of a budgeted layer: score, choose, and compact every part with one order.

:class:`Eviction` is the part a :class:`~.budgeted.BudgetedKV` owns that changes what the layer holds:
``compress`` is the event (in rounds, with demotion, or plain); ``evict`` drops the lowest-scoring tokens of
each row and KV head past the recent window and the shields, tells the listeners, folds them in when
merging, and compacts the store, every per-token state and the slot table by the same order.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..methods.base import EvictionMethod, LayerView
from ..stores.base import KVStore
from ..tokens.merging import MergeState
from ..tokens.rounds import RoundState
from ..tokens.selection import keep_order, lowest
from ..tokens.slots import SlotTable
from ..tokens.state import TokenState
from .demotion import Demotion


def _whole_batch(keep: torch.Tensor, sel: torch.Tensor, batch: int) -> torch.Tensor:
    """``keep`` (len(sel), H_kv, L) widened to every row, the identity order elsewhere."""
    b, h, length = batch, keep.shape[1], keep.shape[2]
    order = torch.arange(length, device=keep.device).expand(b, h, length).clone()
    return order.index_copy_(0, sel, keep)


def _dropped(keep: torch.Tensor, n_drop: torch.Tensor, sel: torch.Tensor | None, batch: int) -> torch.Tensor:
    """Which slots an eviction dropped (B, H_kv, L) bool, from its order ``keep`` (B', H_kv, L) over the rows
    ``sel`` (None: every row) and each of those rows' ``n_drop``: slot ``keep[b, h, j]`` is dropped when its
    rank ``j`` is among the last ``n_drop[b]``."""
    length = keep.shape[-1]
    rank = torch.arange(length, device=keep.device)
    last = rank[None, None, :] >= (length - n_drop.to(keep.device))[:, None, None]  # (B', 1, L)
    dropped = torch.zeros_like(keep, dtype=torch.bool).scatter_(2, keep, last.expand_as(keep))
    if sel is None:
        return dropped
    return torch.zeros((batch, *keep.shape[1:]), dtype=torch.bool, device=keep.device).index_copy_(0, sel, dropped)


class Evicted(Protocol):
    """What an eviction reads and changes of its layer (:class:`~.budgeted.BudgetedKV` is one): its settings, its
    parts, and its counter of events."""

    budget: int
    recent: int
    drop: int
    layer_idx: int
    compressions: int
    method: EvictionMethod
    state: TokenState
    states: list[TokenState]
    store: KVStore
    slots: SlotTable
    shields: list
    listeners: list
    merge: MergeState | None
    rounds: RoundState | None
    demotion: Demotion | None


class Eviction:
    """The compression event of one budgeted layer, a part it owns (``kv.eviction``): it reads the layer's
    settings and changes its store, slot table, per-token states and counter, nothing of its own.

    Parameters
    ----------
    kv : Evicted
        The layer it evicts from.
    """

    def __init__(self, kv: Evicted):
        self.kv = kv

    def view(self, prompt_attention: torch.Tensor | None = None) -> LayerView:
        """The read-only view a method scores (``prompt_attention``: see :class:`..attend.prefill.PromptAware`)."""
        return LayerView(self.kv.layer_idx, self.kv.slots.length, self.kv.compressions, self.kv.state, self.kv.slots,
                         self.kv.store.read, prompt_attention)

    def compress(self, rows: torch.Tensor, drop: int | None = None) -> None:
        """Evict ``drop`` (default: the layer's) tokens from each KV head of the rows ``rows`` (CPU bool, (B,)).

        With tiers, a row evicts only if it is at its budget, and demotes at every width whose cap it reached.
        """
        amount = self.kv.drop if drop is None else drop
        if self.kv.rounds is not None:
            self._round(rows, amount)
            return
        if self.kv.demotion is None:
            self.evict(self.kv.method.score(self.view()), torch.where(rows, amount, 0))
            return
        scores = self.kv.method.score(self.view())
        n_drop = torch.where(rows & (self.kv.slots.lengths >= self.kv.budget), amount, 0)
        if bool((n_drop > 0).any()):
            order = self.evict(scores, n_drop)
            scores = scores.gather(2, order.to(scores.device))[:, :, : self.kv.slots.length]
        shield = self._shield(self.kv.slots.positions[:, :, : scores.shape[-1]])
        self.kv.demotion.demote(scores, rows, amount, self.kv.slots.lengths, self.kv.recent, shield)

    def _round(self, rows: torch.Tensor, amount: int) -> None:
        """Rows ``rows`` with no victim pending choose ``amount``; then each of ``rows`` drops its oldest victim."""
        assert self.kv.rounds is not None
        self.begin_round(rows, amount)
        self.evict(self.kv.rounds.next_out(self.kv.slots.lengths), torch.where(rows, 1, 0))

    def begin_round(self, rows: torch.Tensor, amount: int | None = None) -> None:
        """In rounds, rows ``rows`` (CPU bool, (B,)) with no victim pending score their tokens and choose ``amount``
        (default: the layer's drop) victims; none leaves yet."""
        assert self.kv.rounds is not None
        lengths = self.kv.slots.lengths
        start = rows & (self.kv.rounds.pending(lengths) == 0)
        if bool(start.any()):
            scores = self.kv.method.score(self.view())
            shield = self._shield(self.kv.slots.positions[:, :, : self.kv.slots.length])
            amount = self.kv.drop if amount is None else amount
            self.kv.rounds.choose(lowest(scores, lengths, self.kv.recent, torch.where(start, amount, 0), shield))

    def end_round_block(self, leave: torch.Tensor, gone: int) -> None:
        """After a block in which each row's victims of ``leave`` (B, H_kv, L) below ``gone`` left, one per new
        token: drop them all at once, as ``gone`` events (the count the token-by-token path keeps)."""
        kept = (leave >= gone).to(torch.float32)
        self.evict(kept, torch.full((kept.shape[0],), gone, dtype=torch.long))
        self.kv.compressions += gone - 1

    def _shield(self, positions: torch.Tensor) -> torch.Tensor | None:
        """Slots (B, H_kv, L) no eviction may drop: every shield's mask over ``positions``, or'ed."""
        shield = None
        for part in self.kv.shields:
            mask = part.mask(positions)
            shield = mask if shield is None else shield | mask
        return shield

    def evict(self, scores: torch.Tensor, n_drop: torch.Tensor) -> torch.Tensor:
        """Drop the ``n_drop`` (B,) lowest ``scores`` (B, H_kv, L) of each row and KV head, and compact.

        Returns the order the slots were compacted by, over every row (B, H_kv, L): kept slots first.
        """
        length = scores.shape[-1]
        positions = self.kv.slots.positions[:, :, :length]  # (B, H_kv, L)
        shield = self._shield(positions)
        ranked = scores if self.kv.demotion is None else self.kv.demotion.ranked_for_eviction(scores)
        # Only the rows that drop tokens are ranked and compacted (a ragged batch compresses its rows at
        # different steps); merging folds across every row's slots, so it takes the whole batch.
        dropping = n_drop > 0
        rows = None if self.kv.merge is not None or bool(dropping.all()) else dropping.nonzero().squeeze(1)
        sel = None if rows is None else rows.to(scores.device)
        if sel is None:
            keep = keep_order(ranked, self.kv.slots.lengths, self.kv.recent, n_drop, shield)
        else:
            sub_shield = None if shield is None else shield.expand_as(scores)[sel]
            keep = keep_order(ranked[sel], self.kv.slots.lengths[rows], self.kv.recent, n_drop[rows], sub_shield)
        if self.kv.listeners:
            dropped = _dropped(keep, n_drop if rows is None else n_drop[rows], sel, scores.shape[0])
            for listener in self.kv.listeners:
                listener.evicted_tokens(self.kv.layer_idx, self.kv.slots.seen, positions, scores, dropped)
        if self.kv.merge is not None:
            keys, values = self.kv.store.read(length)
            self.kv.store.write(0, keys, self.kv.merge.fold(keys, values, keep, self.kv.slots.lengths, n_drop))
        self.kv.store.reorder(keep, sel)
        whole = None
        for state in self.kv.states:
            if sel is None:
                state.compact(keep)
            elif state.compacts_rows:
                state.compact(keep, sel)
            else:  # a state that compacts whole batches only (it says so): the identity order in other rows
                whole = _whole_batch(keep, sel, scores.shape[0]) if whole is None else whole
                state.compact(whole)
        self.kv.slots.compact(keep, n_drop, sel)
        self.kv.compressions += 1
        if self.kv.demotion is not None:
            self.kv.demotion.tiers.forget(self.kv.slots.lengths)
        return keep if sel is None else _whole_batch(keep, sel, scores.shape[0])
