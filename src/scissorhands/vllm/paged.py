"""Eviction in rounds over vLLM's paged K/V blocks: one plan per engine step, one compiled call per layer.

vLLM keeps each layer's K/V in blocks of ``N`` tokens,
``kv_cache[num_blocks, H_kv, N, 2 * D]``; within a (block, KV head) the first
half holds K and the second V, in the layout of vLLM's CPU kernel for the
machine and dtype: "vec" (K transposed, ``[D, N]``, then V ``[N, D]``) or
"amx" (bf16 on CPUs with AMX: tiles of 16 tokens; :mod:`.blocks`). The plugin
presents a budgeted layer to vLLM as a sliding window of ``B`` slots (the
budget), so vLLM's own block manager frees every block that falls behind the
window. What this module adds is *which tokens live in those slots*, with the
core's semantics of eviction in rounds (:mod:`scissorhands.core.tokens.rounds`), and
the layer's attention itself, which replaces vLLM's kernel call:

* **A round** (:mod:`.rounds`). When a request's window is full and no victim is pending, the
  layer scores the window's tokens with the method (the core's
  :class:`~scissorhands.core.methods.base.LayerView` over them, in position
  order), picks the ``drop`` lowest with the core's
  :func:`~scissorhands.core.tokens.selection.lowest` (recent window and protected
  spans shielded, older first among equals), and swaps them into the ``drop``
  slots that leave the window next, oldest victim first. The window then
  drops one victim per step with no move, and whole blocks leave it: vLLM
  frees them with no patch to its scheduler. A round moves at most
  ``2 * drop`` slots per KV head.
* **A decode step** attends each request's new query over its window, the
  logical slots ``(p - B, p]``, and adds its probabilities to an importance
  accumulator kept per *physical* slot: one compiled operator per layer for
  every request (:mod:`.kernels`), which reads each window's K and V once,
  where they lie. It records the new token's position. Nothing else runs
  unless a request starts a round.
* **A prompt** (a request's first chunk) is taken by the core's prefill in a
  one-row layer: the same code and numbers as the transformers cache. The
  prompt-aware prefill attends it exactly and evicts it to ``B`` once; the
  streamed one gives each token past the budget the kept set, in rounds (a
  round's tokens are one masked block attention, its victims hidden from the
  query at which each leaves on), and ends with up to ``drop`` victims pending. That gives its outputs, its
  importance and the ``B`` tokens it keeps; pending victims are copied into the
  slots that leave the window next, by rank, and other kept tokens that lie
  before the window into the remaining free slots.
* **One plan per step** (:class:`.planner.Planner`): which rows are prompts, decode
  steps and rounds, as index tensors, computed once on the host from vLLM's
  metadata and shared by every layer; a layer's step reads no value back from a
  tensor.

Keys are stored after rotary embedding and each slot's true position is kept
beside it (``pos``), so a token means its own position whatever slot it is in.
The transformers cache with ``rounds=True`` keeps the same positions (tested).

Nothing here imports vLLM: it is torch on vLLM's tensors, and is tested on
tensors of the same layout without an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scissorhands.core.attend.prefill import KeepPrompt, PromptAware, causal_attention, make_prefill
from scissorhands.core.attend.streaming import attend
from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import Protection

from . import kernels
from .blocks import copy_slots, read_kv
from .rounds import round_layers
from .settings import PluginSettings

if TYPE_CHECKING:
    from .planner import StepPlan


class PagedLayer:
    """One layer's eviction state for every request vLLM runs, kept per physical slot of vLLM's cache.

    Parameters
    ----------
    settings : PluginSettings
    layer_idx : int
    num_heads, num_kv_heads, head_size : int
    scale : float
        Logit scale.
    softcap : float or None
    compiled : bool
        The decode step and the rounds run the compiled operators (:mod:`.kernels`); False runs their torch
        references (tests).
    layout : str
        vLLM's CPU K/V layout (:data:`.kernels.LAYOUTS`).
    fp8 : str or None
        vLLM's 8-bit K/V format (``kv_cache_dtype``: "fp8", "fp8_e4m3", "fp8_e5m2"), or None for the model's dtype.
    k_scale, v_scale : float
        vLLM's fp8 scales: a stored byte's value times these is the key's, the value's.

    Notes
    -----
    Per physical slot and KV head the layer keeps the token's position (int32) and, for methods that score by
    attention, ``n_buckets`` float32 accumulators: 4 bytes for the defaults' one bucket against 2 * D * 4 bytes
    of float32 K/V (under 1% at D = 64), allocated once beside vLLM's cache at the first step.
    """

    def __init__(self, settings: PluginSettings, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int,
                 scale: float, softcap: float | None, compiled: bool = True, layout: str = "vec",
                 fp8: str | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        if layout not in kernels.LAYOUTS:
            raise ValueError(f"layout: vLLM's CPU K/V layout {layout!r} is not one the plugin reads "
                             f"({', '.join(kernels.LAYOUTS)})")
        if fp8 is not None and fp8 not in kernels.FP8:
            raise ValueError(f"kv_cache_dtype: the plugin reads vLLM's fp8 formats {', '.join(kernels.FP8)}, "
                             f"got {fp8!r}")
        self.settings = settings
        self.layout = layout
        self.fp8, self.k_scale, self.v_scale = fp8, float(k_scale), float(v_scale)
        config, part = settings.config, settings.plan.layers[0]  # every layer the plan's one
        self.budget, self.recent, self.drop = part.budget, part.recent, part.drop
        #: A request's window: the slots after what it holds (the budget, less a held prefix: ``settings.window``).
        self.window = self.budget - settings.held_prefix
        self.layer_idx, self.scale, self.softcap = layer_idx, scale, softcap
        self.heads, self.kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.group = num_heads // num_kv_heads
        self.method = settings.method()
        template = self.method.make_state(config)
        self.importance = template if isinstance(template, ImportanceState) else None
        self.shields: list[Protection] = [Protection.prefix(config.sinks)] if config.sinks else []
        if settings.protection() is not None:
            self.shields.append(settings.protection())  # type: ignore[arg-type]
        self.compiled = compiled
        self.decode = kernels.decode if compiled else kernels.decode_reference
        #: Prompts longer than the budget attended by the compiled prompt operator and, for the queries whose
        #: probabilities nothing reads, torch's fused attention (:func:`_hold_fused`); False: by the
        #: core's tiled pass, as the transformers cache attends them.
        self.fused_prompt = compiled
        self.prompts_fused = 0  # prompts attended that way (tests)
        self.head_queries_fused = 0  # of their queries, those attended by torch's fused attention (tests)
        self.acc: torch.Tensor | None = None  # (NB, num_blocks, H_kv, N) float32
        self.pos: torch.Tensor | None = None  # (num_blocks * N, H_kv) int32: each slot's token position
        self.rounds = 0
        self.block = 0  # vLLM's block size, known at the first step
        self.kv_cache: torch.Tensor | None = None  # vLLM's cache of this layer, known at the first step
        #: The engine's path: a step's rounds wait for :meth:`Planner.after_step`, which runs every layer's at once.
        self.defer_rounds = False

    def _budgeted(self, store, prefill=None, rounds: bool = False) -> BudgetedKV:
        """A one-row core layer at these settings (a prompt's, or the transformers cache's in tests): the plan's,
        over the given store, prefill mode and eviction in rounds."""
        made = self.settings.plan.layer(0, self.layer_idx, store=store, prefill=prefill, rounds=rounds,
                                        method=self.method)
        assert isinstance(made, BudgetedKV)  # no head groups: the plugin refuses head-level budgets
        return made

    def nbytes(self) -> int:
        """Bytes of the per-slot state (positions and importance)."""
        return sum(t.numel() * t.element_size() for t in (self.acc, self.pos) if t is not None)

    def _allocate(self, kv_cache: torch.Tensor) -> None:
        nb, h, n, _ = kv_cache.shape
        self.pos = torch.full((nb * n, h), -1, dtype=torch.int32, device=kv_cache.device)
        if self.importance is not None:
            self.acc = torch.zeros(self.importance.n_buckets, nb, h, n, dtype=torch.float32, device=kv_cache.device)

    # -- one engine step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Attend this layer's step and account for it; vLLM's cache update has written the step's K/V.

        query (T, H_q, D), key/value (T, H_kv, D) of the step's tokens, rows in the plan's order; ``output``
        (T, H_q, D) receives every row's attention: the prompts' exact, the decode rows' over their windows.
        """
        if self.pos is None:
            self._allocate(kv_cache)
        assert self.pos is not None
        block = self.block = kv_cache.shape[2]
        self.kv_cache = kv_cache
        for i, a, b, held, cached in plan.prefills:
            if cached:
                self._prefill_after(cached, plan.block_table[i], query[a:b], key[a:b], value[a:b], kv_cache, block,
                                    output[a:b], held)
            else:
                self._prefill(plan.block_table[i], query[a:b], key[a:b], value[a:b], kv_cache, block, output[a:b],
                              held)
        if plan.dec_tok is not None and plan.dec_last is not None:
            self.pos[plan.dec_slots] = plan.dec_last.to(torch.int32)[:, None]
            ctx = torch.empty(plan.dec_tok.shape[0], self.heads, self.head_size)  # (Dn, H_q, D) float32
            count = self.importance is not None and self.importance.form == "count"
            self.decode(query, kv_cache, plan.dec_tok, plan.dec_last, plan.dec_tables, plan.dec_bucket,
                        plan.dec_restart, self.acc, ctx, self.window, self.scale, self.softcap, count, self.layout,
                        self.fp8, self.k_scale, self.v_scale, plan.dec_held)
            output.index_copy_(0, plan.dec_tok, ctx.to(output.dtype))
        if plan.round_window is not None and plan.round_seen is not None and not self.defer_rounds:
            self._round(plan.round_window, plan.round_seen, kv_cache, block)

    def _prefill(self, table_row, q, k, v, kv_cache, block: int, out, held: int = 0) -> None:
        """Attend a prompt exactly, evict it to the budget, and move the kept tokens into the window.

        ``held``: the positions the request keeps where they lie: its held prompt (keep-prompt; a longer first
        chunk is a preempted request recomputed, whose tokens after the held prompt stream into the window as
        generated ones), or its held prefix (protected: the core keeps it, and it stays in its slots).
        """
        assert self.pos is not None
        t = q.shape[0]
        if self.fp8:  # attend and keep what the cache holds: the prompt's K/V as vLLM stored them, in 8 bits
            slots = self._phys(table_row, torch.arange(t), block)[:, None]
            k, v = self._read(kv_cache, slots // block, torch.arange(self.kv_heads)[None, :], slots % block)
        prefill = make_prefill(self.settings.config, self.budget)
        # A streamed prompt runs the decode's rounds (its last round's victims stay pending into the decode), as do
        # the tokens after a held prompt.
        rounds = not isinstance(prefill, PromptAware) or isinstance(prefill, KeepPrompt)
        one = self._budgeted(DenseKVStore(), prefill, rounds=rounds)
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H_kv, T, D)
        one.allocate(k4, v4)
        fused = _hold_fused(one, q, k4, v4, out, self.scale, self.softcap,
                            self.settings.config.query_tile) if self.fused_prompt else None
        if fused is not None:
            self.prompts_fused += 1
            self.head_queries_fused += fused
        else:
            # A held prompt first, then what was generated after it (a preempted request recomputed).
            cuts = [0, held, t] if 0 < held < t and isinstance(prefill, KeepPrompt) else [0, t]
            for a, b in zip(cuts, cuts[1:]):
                ctx = attend(one, q[a:b].transpose(0, 1)[None], k4[:, :, a:b], v4[:, :, a:b], None, self.scale,
                             self.softcap, self.settings.config.query_tile)  # (1, H_q, b - a, D)
                out[a:b].copy_(ctx[0].transpose(0, 1).reshape(out[a:b].shape).to(out.dtype))
        length = int(one.slots.lengths[0])
        kept = one.slots.positions[0, :, :length].long()  # (H_kv, L), ascending
        where = self._phys(table_row, kept, block)
        heads = torch.arange(self.kv_heads)[:, None].expand_as(where)
        if length < t:  # pending victims into the slots that leave first, other tokens before the window into holes
            h0 = min(held, length)  # a held prompt or prefix stays where it is; the window is what follows it
            rank = None if one.rounds is None else one.rounds.rank[0, :, h0:length]
            target = kept.clone()
            target[:, h0:] = window_slots(kept[:, h0:], rank, t)
            moved = target != kept
            if bool(moved.any()):
                dst = self._phys(table_row, target[moved], block)
                copy_slots(kv_cache, self.layout, where[moved], dst, heads[moved], block)
                where = where.clone()
                where[moved] = dst
        self.pos[where, heads] = kept.to(torch.int32)
        if self.acc is not None:
            state = one.state
            assert isinstance(state, ImportanceState)
            self.acc[:, where // block, heads, where % block] = state.acc[:, 0, :, :length].float()

    def _prefill_after(self, cached: int, table_row, q, k, v, kv_cache, block: int, out, held: int) -> None:
        """A sequence whose first ``cached`` tokens vLLM's prefix cache gave (a held prompt's or prefix's blocks,
        shared): the step's tokens are the rest. The cached K/V are read where they lie and the sequence taken as
        :meth:`_prefill` takes it, the cached positions' queries standing in as zeros: held positions are kept
        and never judged, so only their outputs (not this step's) and their own importance (never read: rounds
        score the window after them) depend on them. The step's own queries attend exactly as they would, and they
        alone score the tokens after the held ones (a query attends no later key; the plugin's block manager never
        gives the prompt-aware prefill's observed queries from the cache)."""
        if cached > held:
            raise RuntimeError(f"scissorhands: vLLM's prefix cache gave {cached} tokens of a request that holds "
                               f"{held}; only held blocks are offered to it")
        slots = self._phys(table_row, torch.arange(cached), block)[:, None]
        kc, vc = read_kv(kv_cache, self.layout, slots // block, torch.arange(self.kv_heads)[None, :], slots % block)
        whole = torch.empty(cached + q.shape[0], *out.shape[1:], dtype=out.dtype)
        self._prefill(table_row, torch.cat([q.new_zeros(cached, *q.shape[1:]), q]),
                      torch.cat([kc.to(k.dtype), k]), torch.cat([vc.to(v.dtype), v]), kv_cache, block, whole, held)
        out.copy_(whole[cached:])

    def _round(self, window: torch.Tensor, seen: torch.Tensor, kv_cache, block: int) -> None:
        """Each rounding row picks ``drop`` victims per KV head and swaps them into its window's leaving slots."""
        assert self.pos is not None
        round_layers([self], self.pos[None], None if self.acc is None else self.acc[None], [kv_cache], window, seen,
                     block)

    def _read(self, kv_cache, blocks, heads, offs) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots as the model sees them: float32 from fp8 bytes, else in the cache's dtype."""
        k, v = read_kv(kv_cache, self.layout, blocks, heads, offs)
        if not self.fp8:
            return k, v
        return kernels.dequantize(k, self.fp8, self.k_scale), kernels.dequantize(v, self.fp8, self.v_scale)

    def stored_positions(self, table_row: torch.Tensor, seen: int, held: int = 0) -> torch.Tensor:
        """The positions a request's window (and its ``held`` prompt) holds per KV head, ascending (H_kv, L): tests
        and audits."""
        assert self.pos is not None
        held = min(held, seen)
        positions = torch.cat([torch.arange(held), torch.arange(max(held, seen - self.window), seen)])
        return self.pos[self._phys(table_row, positions, self.block)].T.long().sort(dim=-1).values

    @staticmethod
    def _phys(table_row: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
        """Physical slots of logical ``positions`` (any shape) through one request's block table."""
        return table_row.long()[positions // block] * block + positions % block


def window_slots(kept: torch.Tensor, rank: torch.Tensor | None, seen: int) -> torch.Tensor:
    """Where a prompt's kept tokens go in its window: the logical position each takes (H_kv, L).

    ``kept`` (H_kv, L) are the positions a one-row layer keeps of a ``seen``-token prompt, ascending per head;
    ``rank`` (H_kv, L) their rank among the pending victims of a round (-1: none), or None. The window holds the
    positions ``[seen - L, seen)``; the ``p`` pending victims take its first ``p`` slots in rank order (they leave
    the window one per new token, as the core's victims leave its layer), a token already in the rest of the window
    stays where it is, and the others fill the rest's free slots in position order.
    """
    heads, length = kept.shape
    first = seen - length
    target = kept.clone()
    for h in range(heads):
        victim = torch.zeros(length, dtype=torch.bool) if rank is None else rank[h] >= 0
        order = torch.nonzero(victim).flatten()
        if rank is not None and order.numel():
            order = order[torch.argsort(rank[h, order], stable=True)]
        p = order.numel()
        target[h, order] = first + torch.arange(p)
        stays = ~victim & (kept[h] >= first + p)
        movers = ~victim & ~stays
        if bool(movers.any()):
            free = torch.arange(first + p, seen)
            free = free[~torch.isin(free, kept[h, stays])]
            target[h, movers] = free
    return target


def _hold_fused(one: BudgetedKV, q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, out: torch.Tensor,
                scale: float, softcap: float | None, query_tile: int) -> int | None:
    """A prompt longer than the budget, held whole in the one-row layer ``one`` as the core's prompt-aware prefill
    holds it, attended once by the compiled prompt operator (:func:`.kernels.prompt`): its output and the snapshot
    the core's selection scores (and a count state's counts) in one pass, the queries before the last ``observe``
    by torch's fused attention where nothing reads their probabilities (no count state, no soft cap); then the
    core's own selection (``PromptAware.evict_held``), which also sets the state by its judgement. Returns how
    many queries the fused attention took; None (nothing done) where the core's path is needed: a short prompt,
    a chunked one.

    ``q`` (T, H_q, D) is the prompt's queries, ``k4``/``v4`` (1, H_kv, T, D) its keys and values, ``out``
    (T, H_q, D) receives its attention.
    """
    prefill = one.prefill
    t, h, d = q.shape[0], k4.shape[1], q.shape[-1]
    g = q.shape[1] // h
    if not isinstance(prefill, PromptAware) or isinstance(prefill, KeepPrompt) or prefill.chunk is not None \
            or t <= one.budget:  # a held prompt is kept whole: nothing to select
        return None
    qf = q.float().view(t, h, g, d).permute(1, 2, 0, 3).contiguous()  # (H, g, T, D)
    kf, vf = k4[0].float().contiguous(), v4[0].float().contiguous()  # (H, T, D)
    for each in one.states:  # allocated as the core's attend allocates them, then held as its prefill holds
        each.allocate(1, h, one.capacity, group=g, device=q.device, dtype=torch.float32)
    one.states_ready = True
    one.reserve(t, limit=t)
    one.append(k4, v4, None, torch.arange(1, t + 1)[None])
    # What the prompt's queries leave in the importance state: only a count keeps it past the selection's judgement
    # (``ImportanceState.judged``), so only a count needs the operator to record it.
    counts = one.state if isinstance(one.state, ImportanceState) and not one.state.judged_replaces else None
    acc = None if counts is None else torch.empty(counts.n_buckets, h, t)
    # Without counts, only the last ``observe`` queries' probabilities are read: the queries before them are
    # attended by torch's fused attention (as the core's ``PromptAware._fused_head`` attends them), which has
    # no soft cap.
    head = max(0, t - prefill.observe) if counts is None and softcap is None else 0
    if head:
        ctx = causal_attention(qf[None, :, :, :head], kf[None, :, :head], vf[None, :, :head], scale)  # (1,H,g,head,D)
        out[:head] = ctx[0].reshape(h * g, head, d).transpose(0, 1).to(out.dtype)
    snap = torch.empty(h, t)
    ctx = torch.empty(t - head, h * g, d)
    kernels.prompt(qf[:, :, head:].contiguous(), kf, vf, ctx, acc, snap, scale, softcap, counts is not None,
                   None if counts is None else counts.bucket_steps, max(0, t - prefill.observe), query_tile)
    out[head:] = ctx.to(out.dtype)
    if counts is not None and acc is not None:
        counts.acc[:, 0, :, :t] = acc.round().to(counts.acc.dtype)
    snapshot = torch.zeros(1, h, one.capacity)
    snapshot[0, :, :t] = snap
    prefill.evict_held(one, snapshot, min(prefill.observe, t))
    one.resize(one.budget)
    one.store.settle()
    return head
