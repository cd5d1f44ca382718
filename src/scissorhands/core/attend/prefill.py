"""How a budgeted layer takes a chunk of new tokens: one small strategy per prefill mode.

* :class:`Streamed` (``prefill="stream"``): the chunk is cut into blocks at
  the points where some row must compress (its next real token would not fit
  the budget). Each block is one attention computation over the row's stored
  slots plus the block's own tokens (causally), so a chunk gives exactly what
  feeding its tokens one at a time gives, and the peak is the budget (in rounds, the
  budget plus one round's victims, which a round's block holds until it ends).
* :class:`PromptAware` (``prefill="prompt-aware"``): a first chunk longer
  than the budget (the prompt) is held whole and attended exactly, then scored
  and evicted down to the budget in one step; later chunks stream.

Prefill modes are plug-ins by name, as methods and stores are: ``prefill=NAME`` takes any registered
mode. A new one subclasses :class:`Prefill`, sets ``name``, overrides :meth:`Prefill.take` (and
:meth:`Prefill.from_settings` if it reads settings) and is decorated with :func:`register_prefill`, from any
module; :func:`make_prefill` builds a layer's strategy from the settings. A mode with settings of its own
declares them as a ``Settings`` dataclass of :func:`~scissorhands.core.settings.declare.setting` fields on its
class (as :class:`PromptAware` does): registering the mode makes them settings by name, valid with that mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..registry import Registry
from ..settings.prefill import KeepPromptSettings, PromptAwareSettings, StreamedSettings
from ..stores.base import DenseKVStore
from ..tokens.protect import Protection
from .blocks import attend_block

if TYPE_CHECKING:
    from ..layer.budgeted import BudgetedKV
    from ..settings.config import CacheSettings


class Prefill:
    """Takes a chunk into a layer: stores its real tokens and writes its attention output."""

    name: ClassVar[str] = "base"

    @classmethod
    def from_settings(cls, settings: CacheSettings, layer_budget: int | None = None) -> Prefill:
        """The strategy for one layer of this budget (None: no layer yet, only the settings)."""
        return cls()

    def take(self, kv: BudgetedKV, q, out, key, value, valid, cum, scaling, softcap, query_tile: int) -> None:
        """Store the chunk and write its attention into ``out``.

        q : (B, H_kv, g, T, D); out : (B, H_kv, g, T, D_v), written in place;
        key, value : (B, H_kv, T, D); valid : (B, T) CPU bool or None (all real);
        cum : (B, T) CPU, real tokens up to and including each index.
        """
        raise NotImplementedError


class Streamed(Prefill):
    """Blocks between compression events: the peak is the budget (in rounds, plus one round's victims inside a
    chunk), and the result is token-by-token's.

    Parameters
    ----------
    drop : int, optional
        Tokens each compression event of a chunk of several tokens evicts
        (``prefill_drop``). None: the layer's ``drop``, which makes the chunk
        exactly what feeding its tokens one at a time gives. A larger amount
        means fewer events, each admitting a larger block; the peak stays the
        budget (in rounds, the budget plus one round).
    """

    name = "stream"
    Settings = StreamedSettings  # prefill_drop: valid only with this mode (and modes built on it)

    def __init__(self, drop: int | None = None, block_rounds: bool = True):
        self.drop = drop
        #: In rounds, take a round's tokens as one block (its victims held beside the budget until it ends);
        #: False keeps the peak at the budget, as a memory target needs (:meth:`CachePlan.prefill`).
        self.block_rounds = block_rounds

    @classmethod
    def from_settings(cls, settings, layer_budget=None):
        return cls(None if layer_budget is None else settings.prefill_drop_for(layer_budget))

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
        in_rounds = self.block_rounds and _blocks_rounds(kv)
        i = 0
        while i < total:
            room = kv.room_uniform()
            if room <= 0 and in_rounds:
                kv.eviction.begin_round(every, drop)
                assert kv.rounds is not None
                k = min(total - i, int(kv.rounds.pending(kv.slots.lengths).min()))
                if k > 1:
                    self._round_block(kv, q, out, key, value, i, i + k, scaling, softcap, query_tile)
                    i += k
                    continue
            if room <= 0:
                kv.compress(every, drop)
                room = kv.room_uniform()
            e = min(total, i + room)
            bcum = cum[:, i:e] - i
            base = kv.slots.lengths.clone()
            kv.append(key[:, :, i:e], value[:, :, i:e], None, bcum)
            attend_block(kv, q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, None, scaling, softcap, query_tile)
            i = e
        most = kv.budget + kv.held_first  # a round's block held its victims beside the budget: give the room back
        if in_rounds and kv.capacity > most >= kv.slots.length:
            kv.resize(most)

    @staticmethod
    def _round_block(kv, q, out, key, value, i: int, e: int, scaling, softcap, query_tile) -> None:
        """Tokens ``[i, e)`` of a full layer in rounds, each evicting the next of the round's pending victims, as one
        block: the victims stay stored (masked from the query at which each leaves on) until the block ends, then
        all leave at once. What the tokens one at a time give, in one attention computation instead of ``e - i``.
        """
        assert kv.rounds is not None
        k, stored = e - i, kv.slots.length
        rank = kv.rounds.rank[:, :, :stored]
        live = rank >= 0
        first = torch.where(live, rank, torch.iinfo(rank.dtype).max).amin(dim=-1, keepdim=True)
        leave = torch.where(live, rank - first, k).to(torch.long)  # (B, H_kv, L): the query each victim leaves at
        leave = torch.cat([leave, leave.new_full((*leave.shape[:2], k), k)], dim=-1)  # the block's tokens stay
        kv.reserve(stored + k, limit=stored + k)
        bcum = torch.arange(1, k + 1).expand(q.shape[0], k)
        base = kv.slots.lengths.clone()
        kv.append(key[:, :, i:e], value[:, :, i:e], None, bcum)
        attend_block(kv, q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, None, scaling, softcap, query_tile,
                     leave=leave)
        kv.eviction.end_round_block(leave, k)


def _blocks_rounds(kv: BudgetedKV) -> bool:
    """Whether a layer in rounds may take a round's tokens as one block (:meth:`Streamed._round_block`): a plain
    dense store (a residual or packed store reads by slot index, which the victims still hold), and no listener
    (an audit records each token's eviction at its own step)."""
    return kv.rounds is not None and type(kv.store) is DenseKVStore and not kv.listeners and kv.merge is None


class PromptAware(Prefill):
    """Hold the prompt, attend over it exactly, then evict down to the budget in one step.

    The prompt's tokens are scored by the method (:meth:`EvictionMethod.score`)
    with the view's ``prompt_attention``: the attention the prompt's last
    ``observe`` queries pay each slot (summed over the query heads of a group).
    Methods that score by attention use it; it is then max-pooled over ``pool``
    neighbouring slots so that a fact spanning several tokens stays whole, and
    those last queries themselves are kept. Other methods (position or random
    based) score the held prompt their own way. The layer's per-token state is
    told the judgement before the eviction (``TokenState.judged``): the
    importance ring takes it as the kept tokens' history, so that decoding
    ranks them as the selection did. Peak memory is the prompt's length; from
    the next token on the budget holds as usual.

    With ``chunk`` (``prompt_chunk``) the prompt is taken ``chunk`` tokens at a
    time: while the stored tokens and the next chunk fit the budget, the chunk
    streams in; after that each chunk is held beside the stored tokens, attends
    exactly over them and itself, and its own last ``observe`` queries score
    every stored token and evict back to the budget. The peak is the budget
    plus one chunk. A chunk as long as the prompt is the unchunked prefill.

    Parameters
    ----------
    observe : int
        The prompt's (or each chunk's) last queries that score it.
    pool : int
        Odd max-pool width over neighbouring slots (1: none).
    chunk : int, optional
        Most prompt tokens held beside the budget at once; None: the whole prompt.
    """

    name = "prompt-aware"
    Settings = PromptAwareSettings  # observe, prompt_chunk, pool: valid only with this mode

    def __init__(self, observe: int, pool: int, chunk: int | None = None, stream: Streamed | None = None):
        self.observe, self.pool, self.chunk = observe, pool, chunk
        self.stream = stream or Streamed()

    @classmethod
    def from_settings(cls, settings, layer_budget=None):
        return cls(settings.observe, settings.pool, settings.prompt_chunk,
                   Streamed.from_settings(settings, layer_budget))

    def take(self, kv, q, out, key, value, valid, cum, scaling, softcap, query_tile):
        if kv.slots.length != 0 or int(cum[:, -1].max()) <= kv.budget:
            return self.stream.take(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
        real = cum[:, -1]
        if self.chunk is None or self.chunk >= int(real.max()):
            self._hold(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
            kv.resize(kv.budget)
            return
        # Chunk k of a row is its real tokens k*C+1 .. (k+1)*C, wherever padding puts them, so that a row of a
        # padded batch is cut as it would be alone.
        c = self.chunk
        every = valid if valid is not None else torch.ones_like(cum, dtype=torch.bool)
        for k in range(-(-int(real.max()) // c)):
            mine = every & (cum > k * c) & (cum <= (k + 1) * c)  # (B, T)
            cols = mine.any(dim=0).nonzero().squeeze(1)
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            bvalid = mine[:, lo:hi]
            whole = bool(bvalid.all())
            # Columns of other chunks inside the span are padding to this one: it writes them in a buffer of its
            # own, and only its real queries are copied out.
            part_out = out[:, :, :, lo:hi] if whole else torch.zeros_like(out[:, :, :, lo:hi])
            bcum = bvalid.long().cumsum(dim=1)
            part = (kv, q[:, :, :, lo:hi], part_out, key[:, :, lo:hi], value[:, :, lo:hi], None if whole else bvalid,
                    bcum, scaling, softcap, query_tile)
            if int((kv.slots.lengths + bcum[:, -1]).max()) <= kv.budget:
                self.stream.take(*part)  # it fits: nothing to evict yet
            else:
                self._hold(*part)
            if not whole:
                take = bvalid.to(out.device)[:, None, None, :, None]  # (B, 1, 1, c, 1)
                out[:, :, :, lo:hi] = torch.where(take, part_out, out[:, :, :, lo:hi])
        kv.resize(kv.budget)

    def _hold(self, kv, q, out, key, value, valid, cum, scaling, softcap, query_tile, target=None) -> None:
        """Store a chunk beside what is stored, attend over both exactly, and evict back to the budget (or each
        row's ``target``) by the chunk's last ``observe`` queries."""
        b = q.shape[0]
        real = cum[:, -1]  # (B,) real tokens of the chunk per row
        base = kv.slots.lengths.clone()
        most = int((base + real).max())
        kv.reserve(most, limit=most)
        kv.append(key, value, valid, cum)
        watch = (cum > (real - self.observe)[:, None]) & (valid if valid is not None else True)  # (B, c)
        snap = torch.zeros(b, key.shape[1], kv.capacity, device=q.device)  # (B, H_kv, capacity)
        fused = self._fused_head(kv, q, out, valid, base, scaling, softcap)  # > 0 only where valid is None
        attend_block(kv, q[:, :, :, fused:], out[:, :, :, fused:], base, cum[:, fused:], valid, scaling, softcap,
                     query_tile, (watch[:, fused:], snap))  # the rest, with the judging queries' probabilities
        self.evict_held(kv, snap, real.clamp(max=self.observe), target)

    def _fused_head(self, kv, q, out, valid, base, scaling, softcap) -> int:
        """Attend a whole held prompt's queries before its last ``observe`` by PyTorch's fused attention, and
        return how many (0: none, where the exact tiles are needed).

        Their probabilities are needed by nothing: the method scores the held prompt by what the last queries
        paid (``held_prompt_by_snapshot``), and the layer's state takes that judgement as each kept slot's whole
        history (``judged_replaces``). So only the last queries go through the tiles that write probabilities,
        and the rest cost what a full cache's prefill costs. That holds for a first chunk without padding over a
        dense store, with no soft cap and no merging; otherwise every query takes the tiles. The outputs equal
        the tiles' to float rounding (the tests hold them to each other); the kept tokens are the same.
        """
        t = q.shape[3]
        first = t - self.observe
        if (first < 1 or valid is not None or softcap is not None or kv.merge is not None
                or not isinstance(kv.store, DenseKVStore) or int(base.max()) != 0):
            return 0
        if kv.state.wants_attention and not (kv.method.held_prompt_by_snapshot and kv.state.judged_replaces):
            return 0
        keys, values = kv.store.read(first)  # (B, H_kv, first, D): the prompt's first tokens, in order
        if keys.dtype != q.dtype or values.dtype != q.dtype:
            return 0
        out[:, :, :, :first] = causal_attention(q[:, :, :, :first], keys, values, scaling)
        return first

    def kept_observed(self, budget: int) -> int:
        """How many of the observed queries' own tokens the selection keeps whatever they score: all ``observe``
        of them, up to a quarter of the layer's budget (the defaults' recent window); beyond it they compete by
        their scores with the rest. Kept whole at a budget of ``observe`` or less they would fill it, and the
        selection would hold the prompt's tail and nothing it scored: HumanEval at 5x on Qwen2.5-Coder-0.5B (28
        tokens a layer against 32 observed) passed no problem so, 3 of 50 with half the budget, and 7 of 50
        with a quarter (docs/results.md)."""
        return min(self.observe, budget // 4)

    def evict_held(self, kv, snap: torch.Tensor, watched: int | torch.Tensor | None = None,
                   target: torch.Tensor | None = None) -> None:
        """Score what a layer holds beside its budget by ``snap`` (B, H_kv, >= length), the attention its last
        ``watched`` queries (an int, or one per row; default ``observe``) paid each slot, and evict back to the
        budget (or to each row's ``target``, (B,)), keeping the newest :meth:`kept_observed` tokens. The layer's
        states are told the judgement first (:meth:`~scissorhands.core.tokens.state.TokenState.judged`), so that
        decoding ranks what is kept as the selection did. (An adapter that attends a held prompt by other means
        calls this with the same snapshot; the selection is this one.)"""
        goal = torch.full_like(kv.slots.lengths, kv.budget) if target is None else target
        length = kv.slots.length
        scores = kv.method.score(kv.view(prompt_attention=snap[:, :, :length]))  # (B, H_kv, L)
        if kv.state.wants_attention:
            if self.pool > 1:
                pooled = torch.nn.functional.max_pool1d(scores.reshape(-1, 1, length), kernel_size=self.pool,
                                                        stride=1, padding=self.pool // 2)
                scores = pooled.view_as(scores)
            positions = kv.slots.positions[:, :, :length].long()
            seen = kv.slots.seen.to(snap.device)[:, None, None]  # (B, 1, 1): the chunk's end
            n = torch.as_tensor(self.observe if watched is None else watched).expand(kv.slots.lengths.shape)
            n = torch.where(kv.slots.lengths > goal, n, 0).to(snap.device)  # a row within its budget: not judged
            saw = torch.minimum((seen - positions).clamp(min=1), n[:, None, None])  # watched queries per slot (or 0)
            for state in kv.states:
                state.judged(scores, saw.to(scores.dtype), positions, kv.slots.seen)
            scores = scores.clone()
            last = positions >= seen - self.kept_observed(kv.budget if target is None else int(goal.min()))
            # Above any attention score but below the shields (recent window, protected spans), which stay inf.
            scores.masked_fill_(last, torch.finfo(scores.dtype).max)
        kv.evict(scores, (kv.slots.lengths - goal).clamp(min=0))


class KeepPrompt(PromptAware):
    """Keep the prompt beside the budget, and evict only what is generated after it (``prefill="keep-prompt"``).

    The first chunk a layer takes is the prompt. Each row keeps ``prompt_keep`` of it (a fraction of its
    prompt's real tokens, rounded up, or a count; None: all of it) until the sequence ends: a prompt kept whole
    streams in with no eviction; a prompt kept in part is held whole, attended exactly and judged by its last
    ``observe`` queries as the prompt-aware prefill judges it (:meth:`PromptAware.evict_held`), down to its kept
    count. The kept prompt is then shielded from every later eviction (:meth:`BudgetedKV.hold`), and the budget
    holds the tokens after it: a row stores at most its kept prompt plus the budget, and generated tokens are
    evicted at the budget as usual. Later chunks (a second turn) stream under the same rule.

    A row of a padded batch keeps what it would keep alone: its own prompt's length sets its kept count.

    Parameters
    ----------
    keep : float or int, optional
        ``prompt_keep``: a fraction in (0, 1) of each prompt, a count of its tokens, or None for all of it.
    observe, pool : int
        As :class:`PromptAware`'s: the queries that judge a prompt kept in part, and the pooling of their scores.
    """

    name = "keep-prompt"
    Settings = KeepPromptSettings  # type: ignore[assignment]  # prompt_keep, and the judging observe and pool

    def __init__(self, keep: float | int | None, observe: int, pool: int, stream: Streamed | None = None):
        super().__init__(observe, pool, None, stream)
        self.keep = keep

    @classmethod
    def from_settings(cls, settings, layer_budget=None):
        return cls(settings.prompt_keep, settings.observe, settings.pool,
                   Streamed.from_settings(settings, layer_budget))

    @staticmethod
    def _protected(kv, real: torch.Tensor, within: bool) -> torch.Tensor:
        """Each row's (B,) protected positions (sinks, protected spans) inside its prompt of ``real`` tokens, with
        its recent window, or after it: those inside are kept with it, whatever ``prompt_keep`` says; those after
        count against the budget, as a streamed layer's do."""
        reals = real.tolist()
        rows: list[list[tuple[int, int]]] = [[(max(0, n - kv.recent), n)] if within and kv.recent else []
                                             for n in reals]
        for shield in kv.shields:
            if isinstance(shield, Protection):
                for b in range(len(reals)):
                    rows[b].extend(shield.rows[b if len(shield.rows) > 1 else 0])
        lo, hi = ([0] * len(reals), reals) if within else (reals, [float("inf")] * len(reals))
        return torch.tensor(Protection(rows).counts_in(lo, hi), dtype=real.dtype)

    def kept(self, real: torch.Tensor) -> torch.Tensor:
        """How many of each row's ``real`` (B,) prompt tokens it keeps."""
        if self.keep is None:
            return real.clone()
        if isinstance(self.keep, float):
            return torch.ceil(real.double() * self.keep).long().clamp(min=1).minimum(real)
        return real.clamp(max=self.keep)

    def take(self, kv, q, out, key, value, valid, cum, scaling, softcap, query_tile):
        if kv.slots.length != 0 or kv.held is not None:
            return self.stream.take(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
        real = cum[:, -1]  # (B,) each row's prompt
        kept = torch.maximum(self.kept(real), self._protected(kv, real, within=True))  # recent window included
        after = self._protected(kv, real, within=False)
        room = kv.budget - kv.recent - kv.drop
        if bool((after > room).any()):
            worst = int(after.argmax())
            raise ValueError(f"protect: {int(after[worst])} protected tokens after the prompt (sequence {worst}) do "
                             f"not fit: a layer budget of {kv.budget} keeps {kv.recent} recent tokens and must be "
                             f"able to evict {kv.drop} at once, which leaves room for at most {room}")
        if bool((kept == real).all()):
            kv.hold(kept, real)  # room for the whole prompt beside the budget: it streams in, nothing evicted
            self.stream.take(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
            return
        self._hold(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile, target=kept)
        kv.hold(kept, real)
        kv.resize(kv.budget + int(kept.max()))


PREFILLS: Registry[type[Prefill]] = Registry("register_prefill", Prefill, axis="prefill")


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact causal attention of a prompt's first queries over its own first keys, by PyTorch's fused attention
    (no probabilities): q (B, H_kv, g, T, D), keys and values (B, H_kv, T, D); returns (B, H_kv, g, T, D). The
    KV heads are repeated for their ``g`` query heads (the fused kernels take no grouping on every CPU build)."""
    b, h, g, t, d = q.shape
    if g > 1:
        keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
    ctx = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, h * g, t, d), keys, values, is_causal=True,
                                                           scale=scale)
    return ctx.view(b, h, g, t, -1)


def register_prefill(cls: type[Prefill]) -> type[Prefill]:
    """Class decorator: make ``cls`` available as ``prefill=cls.name``."""
    return PREFILLS.register(cls)


def unregister_prefill(name: str) -> None:
    """Remove a registered prefill mode (for tests and experiments)."""
    PREFILLS.unregister(name)


def make_prefill(settings: CacheSettings, layer_budget: int | None = None) -> Prefill:
    """The strategy ``settings.prefill`` names, with its settings (``prefill_drop`` needs the layer's budget)."""
    if settings.prefill not in PREFILLS:
        raise ValueError(f"prefill: unknown prefill mode {settings.prefill!r}; choose from {', '.join(PREFILLS)}")
    return PREFILLS[settings.prefill].from_settings(settings, layer_budget)


register_prefill(Streamed)
register_prefill(PromptAware)
register_prefill(KeepPrompt)
