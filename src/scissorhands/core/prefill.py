"""How a budgeted layer takes a chunk of new tokens: one small strategy per prefill mode.

* :class:`Streamed` (``prefill="stream"``): the chunk is cut into blocks at
  the points where some row must compress (its next real token would not fit
  the budget). Each block is one attention computation over the row's stored
  slots plus the block's own tokens (causally), so a chunk gives exactly what
  feeding its tokens one at a time gives, and the peak is the budget.
* :class:`PromptAware` (``prefill="prompt-aware"``): a first chunk longer
  than the budget (the prompt) is held whole and attended exactly, then scored
  and evicted down to the budget in one step; later chunks stream.

A strategy is chosen from the settings by :func:`make_prefill`; a new one
subclasses :class:`Prefill`, overrides :meth:`Prefill.take` and registers in
:data:`PREFILLS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from .blocks import attend_block
from .config import DEFAULTS

if TYPE_CHECKING:
    from .budgeted import BudgetedKV
    from .config import CacheSettings


class Prefill:
    """Takes a chunk into a layer: stores its real tokens and writes its attention output."""

    name: ClassVar[str] = "base"

    def take(self, kv: BudgetedKV, q, out, key, value, valid, cum, scaling, softcap, query_tile: int) -> None:
        """Store the chunk and write its attention into ``out``.

        q : (B, H_kv, g, T, D); out : (B, H_kv, g, T, D_v), written in place;
        key, value : (B, H_kv, T, D); valid : (B, T) CPU bool or None (all real);
        cum : (B, T) CPU, real tokens up to and including each index.
        """
        raise NotImplementedError


class Streamed(Prefill):
    """Blocks between compression events: the peak is the budget, and the result is token-by-token's.

    Parameters
    ----------
    drop : int, optional
        Tokens each compression event of a chunk of several tokens evicts
        (``prefill_drop``). None: the layer's ``drop``, which makes the chunk
        exactly what feeding its tokens one at a time gives. A larger amount
        means fewer events, each admitting a larger block; the peak stays the
        budget.
    """

    name = "stream"

    def __init__(self, drop: int | None = None):
        self.drop = drop

    def take(self, kv, q, out, key, value, valid, cum, scaling, softcap, query_tile):
        b, total = cum.shape
        drop = self.drop if total > 1 else None  # one token (a padded decode step) decodes as usual
        if valid is None and kv.slots.uniform is not None:
            return self._aligned(kv, q, out, key, value, cum, scaling, softcap, query_tile, drop)
        i = 0
        while i < total:
            before = cum[:, i - 1] if i > 0 else torch.zeros(b, dtype=torch.long)
            coming = cum[:, -1] - before  # real tokens left per row
            full = (kv.room() <= 0) & (coming > 0)
            if bool(full.any()):
                kv.compress(full, drop)
            lengths = kv.slots.lengths
            free = kv.room()  # (B,)
            # Block end: the first index at which some row would exceed its free space.
            over = (cum - before[:, None]) > free[:, None]  # (B, T)
            over[:, :i] = False
            stops = torch.where(over.any(dim=1), over.float().argmax(dim=1), total)
            e = int(stops.min())
            bcum = cum[:, i:e] - before[:, None]  # (B, c)
            bvalid = None if valid is None else valid[:, i:e]
            base = lengths.clone()
            kv.append(key[:, :, i:e], value[:, :, i:e], bvalid, bcum)
            attend_block(kv, q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, bvalid, scaling, softcap, query_tile)
            i = e

    def _aligned(self, kv, q, out, key, value, cum, scaling, softcap, query_tile, drop) -> None:
        """No padding and every row at the same length: the same blocks, planned with Python integers.

        Equal to the general loop block for block (a row that is full compresses, then a block fills the
        free slots), without its dozen small tensor operations per event.
        """
        b, total = cum.shape
        every = torch.ones(b, dtype=torch.bool)
        i = 0
        while i < total:
            room = kv.room_uniform()
            if room <= 0:
                kv.compress(every, drop)
                room = kv.room_uniform()
            e = min(total, i + room)
            bcum = cum[:, i:e] - i
            base = kv.slots.lengths.clone()
            kv.append(key[:, :, i:e], value[:, :, i:e], None, bcum)
            attend_block(kv, q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, None, scaling, softcap, query_tile)
            i = e


class PromptAware(Prefill):
    """Hold the whole prompt, attend over it exactly, then evict down to the budget in one step.

    The prompt's tokens are scored by the method (:meth:`EvictionMethod.score`)
    with the view's ``prompt_attention``: the attention the prompt's last
    ``observe`` queries pay each slot (summed over the query heads of a group).
    Methods that score by attention use it; it is then max-pooled over ``pool``
    neighbouring slots so that a fact spanning several tokens stays whole, and
    those last queries themselves are kept. Other methods (position or random
    based) score the held prompt their own way. Peak memory is the prompt's
    length; from the next token on the budget holds as usual.

    Parameters
    ----------
    observe : int
        The prompt's last queries that score it.
    pool : int
        Odd max-pool width over neighbouring slots (1: none).
    """

    name = "prompt-aware"

    def __init__(self, observe: int = DEFAULTS.observe, pool: int = DEFAULTS.pool):
        self.observe, self.pool = observe, pool
        self.stream = Streamed()

    def take(self, kv, q, out, key, value, valid, cum, scaling, softcap, query_tile):
        if kv.slots.length != 0 or int(cum[:, -1].max()) <= kv.budget:
            return self.stream.take(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
        b = q.shape[0]
        real = cum[:, -1]  # (B,) real tokens per row
        kv.reserve(int(real.max()), limit=int(real.max()))
        kv.append(key, value, valid, cum)
        watch = (cum > (real - self.observe)[:, None]) & (valid if valid is not None else True)  # (B, T)
        snap = torch.zeros(b, key.shape[1], kv.capacity, device=q.device)  # (B, H_kv, capacity)
        attend_block(kv, q, out, torch.zeros(b, dtype=torch.long), cum, valid, scaling, softcap, query_tile,
                     (watch, snap))
        length = kv.slots.length
        scores = kv.method.score(kv.view(prompt_attention=snap[:, :, :length]))  # (B, H_kv, L)
        if kv.state.wants_attention:
            if self.pool > 1:
                pooled = torch.nn.functional.max_pool1d(scores.reshape(-1, 1, length), kernel_size=self.pool,
                                                        stride=1, padding=self.pool // 2)
                scores = pooled.view_as(scores)
            scores = scores.clone()
            last = kv.slots.positions[:, :, :length] >= (real - self.observe).to(q.device)[:, None, None]
            # Above any attention score but below the shields (recent window, protected spans), which stay inf.
            scores.masked_fill_(last, torch.finfo(scores.dtype).max)
        kv.evict(scores, (real - kv.budget).clamp(min=0))
        kv.resize(kv.budget)


PREFILLS: dict[str, type[Prefill]] = {"stream": Streamed, "prompt-aware": PromptAware}


def make_prefill(settings: CacheSettings, layer_budget: int | None = None) -> Prefill:
    """The strategy ``settings.prefill`` names, with its settings (``prefill_drop`` needs the layer's budget)."""
    drop = None if layer_budget is None else settings.prefill_drop_for(layer_budget)
    if settings.prefill == "prompt-aware":
        strategy = PromptAware(settings.observe, settings.pool)
        strategy.stream = Streamed(drop)
        return strategy
    if settings.prefill == "stream":
        return Streamed(drop)
    return PREFILLS[settings.prefill]()
