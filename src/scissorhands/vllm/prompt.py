"""A request's prompt in a paged layer: attended exactly, evicted to the budget by the core's prefill in a one-row
layer, and its kept tokens moved into the request's window (:class:`.paged.PagedLayer` takes each prompt of a step
here).

The one-row layer is the transformers cache's own (the plan's layer over a dense store), so a prompt keeps the same
tokens and the same importance on both paths. A prompt longer than the budget under the prompt-aware prefill is
attended by the compiled prompt operator (:func:`hold_fused`); a prompt whose first blocks vLLM's prefix cache gave
(a held prompt's or prefix's) is read back from the cache and taken whole (:func:`prefill_after`).
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
from .blocks import copy_slots, phys, read_kv

if TYPE_CHECKING:
    from .paged import PagedLayer


def prefill(layer: PagedLayer, table_row, q, k, v, kv_cache, out, held: int = 0,
            spans: list[tuple[int, int]] | None = None) -> None:
    """Attend a prompt exactly, evict it to the budget, and move the kept tokens into the window.

    ``held``: the positions the request keeps where they lie: its held prompt (keep-prompt; a longer first
    chunk is a preempted request recomputed, whose tokens after the held prompt stream into the window as
    generated ones), or its held prefix (protected: the core keeps it, and it stays in its slots). ``spans``: the
    request's own protected spans, which the one-row layer keeps as the transformers cache keeps ``protect=``.
    """
    assert layer.pos is not None
    t, block = q.shape[0], layer.block
    if held_whole(layer, table_row, q, k, v, kv_cache, out, 0, held):
        return
    if layer.fp8:  # attend and keep what the cache holds: the prompt's K/V as vLLM stored them, in 8 bits
        slots = phys(table_row, torch.arange(t), block)[:, None]
        k, v = layer.read(kv_cache, slots // block, torch.arange(layer.kv_heads)[None, :], slots % block)
    mode = make_prefill(layer.settings.config, layer.budget)
    # A streamed prompt runs the decode's rounds (its last round's victims stay pending into the decode), as do
    # the tokens after a held prompt.
    rounds = not isinstance(mode, PromptAware) or isinstance(mode, KeepPrompt)
    one = layer.budgeted(DenseKVStore(), mode, rounds=rounds)
    if spans:
        one.given_shields.append(Protection([list(spans)]))
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H_kv, T, D)
    one.allocate(k4, v4)
    fused = hold_fused(one, q, k4, v4, out, layer.scale, layer.softcap,
                       layer.settings.config.query_tile) if layer.fused_prompt else None
    if fused is not None:
        layer.prompts_fused += 1
        layer.head_queries_fused += fused
    else:
        # A held prompt first, then what was generated after it (a preempted request recomputed).
        cuts = [0, held, t] if 0 < held < t and isinstance(mode, KeepPrompt) else [0, t]
        for a, b in zip(cuts, cuts[1:]):
            ctx = attend(one, q[a:b].transpose(0, 1)[None], k4[:, :, a:b], v4[:, :, a:b], None, layer.scale,
                         layer.softcap, layer.settings.config.query_tile)  # (1, H_q, b - a, D)
            out[a:b].copy_(ctx[0].transpose(0, 1).reshape(out[a:b].shape).to(out.dtype))
    length = int(one.slots.lengths[0])
    kept = one.slots.positions[0, :, :length].long()  # (H_kv, L), ascending
    where = phys(table_row, kept, block)
    heads = torch.arange(layer.kv_heads)[:, None].expand_as(where)
    if length < t:  # pending victims into the slots that leave first, other tokens before the window into holes
        h0 = min(held, length)  # a held prompt or prefix stays where it is; the window is what follows it
        rank = None if one.rounds is None else one.rounds.rank[0, :, h0:length]
        target = kept.clone()
        target[:, h0:] = window_slots(kept[:, h0:], rank, t)
        moved = target != kept
        if bool(moved.any()):
            dst = phys(table_row, target[moved], block)
            copy_slots(kv_cache, layer.layout, where[moved], dst, heads[moved], block)
            where = where.clone()
            where[moved] = dst
    layer.pos[where, heads] = kept.to(torch.int32)
    if layer.acc is not None:
        state = one.state
        assert isinstance(state, ImportanceState)
        layer.acc[:, where // block, heads, where % block] = state.acc[:, 0, :, :length].float()


def prefill_after(layer: PagedLayer, cached: int, table_row, q, k, v, kv_cache, out, held: int,
                  spans: list[tuple[int, int]] | None = None) -> None:
    """A sequence whose first ``cached`` tokens vLLM's prefix cache gave (a held prompt's or prefix's blocks,
    shared): the step's tokens are the rest. The cached K/V are read where they lie and the sequence taken as
    :func:`prefill` takes it, the cached positions' queries standing in as zeros: held positions are kept
    and never judged, so only their outputs (not this step's) and their own importance (never read: rounds
    score the window after them) depend on them. The step's own queries attend exactly as they would, and they
    alone score the tokens after the held ones (a query attends no later key; the plugin's block manager never
    gives the prompt-aware prefill's observed queries from the cache)."""
    if cached > held:
        raise RuntimeError(f"scissorhands: vLLM's prefix cache gave {cached} tokens of a request that holds "
                           f"{held}; only held blocks are offered to it")
    if held_whole(layer, table_row, q, k, v, kv_cache, out, cached, held):
        return
    block = layer.block
    slots = phys(table_row, torch.arange(cached), block)[:, None]
    kc, vc = read_kv(kv_cache, layer.layout, slots // block, torch.arange(layer.kv_heads)[None, :], slots % block)
    whole = torch.empty(cached + q.shape[0], *out.shape[1:], dtype=out.dtype)
    prefill(layer, table_row, torch.cat([q.new_zeros(cached, *q.shape[1:]), q]),
            torch.cat([kc.to(k.dtype), k]), torch.cat([vc.to(v.dtype), v]), kv_cache, whole, held, spans)
    out.copy_(whole[cached:])


def held_whole(layer: PagedLayer, table_row, q, k, v, kv_cache, out, cached: int, held: int) -> bool:
    """A prompt the request holds whole (``prefill="keep-prompt"``, a new request: its sequence is its prompt),
    of which the step computes the tokens after vLLM's ``cached`` ones: nothing of it is evicted and its tokens are
    never judged (the rounds score the window after it), so it is attended exactly as vLLM attends a prompt, in one
    call of torch's fused attention over the cached K/V read back and the step's own, and its positions recorded
    where vLLM wrote them. The core's one-row layer gives the same outputs and positions at several times the cost
    (it attends every position, the cached ones as zero queries, in tiles). Returns False, doing nothing, where that
    path is needed: a recomputed request (tokens after its held prompt stream into the window), a soft cap (the
    fused attention has none)."""
    n = q.shape[0]
    t = cached + n
    if not (layer.settings.config.prefill == "keep-prompt" and held >= t and layer.softcap is None):
        return False
    block, heads = layer.block, torch.arange(layer.kv_heads)[None, :]
    where = phys(table_row, torch.arange(t), block)  # (t,)
    keys, values = k, v
    if layer.fp8 or cached:  # what the cache holds: the cached blocks (with fp8, every token's 8-bit values)
        read = (where if layer.fp8 else where[:cached])[:, None]
        kr, vr = layer.read(kv_cache, read // block, heads, read % block)  # (t or cached, H_kv, D)
        keys, values = (kr, vr) if layer.fp8 else (torch.cat([kr.to(k.dtype), k]), torch.cat([vr.to(v.dtype), v]))
    causal = torch.arange(t)[None, :] <= (cached + torch.arange(n))[:, None]  # (n, t)
    ctx = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None],
        attn_mask=causal, scale=layer.scale, enable_gqa=True)  # (1, H_q, n, D)
    out.copy_(ctx[0].transpose(0, 1).reshape(out.shape).to(out.dtype))
    layer.prompts_held_whole += 1
    assert layer.pos is not None
    layer.pos[where] = torch.arange(t, dtype=torch.int32)[:, None]
    if layer.acc is not None:  # never read (held tokens are not judged); cleared of a freed block's last request
        layer.acc[:, where // block, :, where % block] = 0.0
    return True


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


def hold_fused(one: BudgetedKV, q: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, out: torch.Tensor,
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
    mode = one.prefill
    t, h, d = q.shape[0], k4.shape[1], q.shape[-1]
    g = q.shape[1] // h
    if not isinstance(mode, PromptAware) or isinstance(mode, KeepPrompt) or mode.chunk is not None \
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
    head = max(0, t - mode.observe) if counts is None and softcap is None else 0
    if head:
        ctx = causal_attention(qf[None, :, :, :head], kf[None, :, :head], vf[None, :, :head], scale)  # (1,H,g,head,D)
        out[:head] = ctx[0].reshape(h * g, head, d).transpose(0, 1).to(out.dtype)
    snap = torch.empty(h, t)
    ctx = torch.empty(t - head, h * g, d)
    kernels.prompt(qf[:, :, head:].contiguous(), kf, vf, ctx, acc, snap, scale, softcap, counts is not None,
                   None if counts is None else counts.bucket_steps, max(0, t - mode.observe), query_tile)
    out[head:] = ctx.to(out.dtype)
    if counts is not None and acc is not None:
        counts.acc[:, 0, :, :t] = acc.round().to(counts.acc.dtype)
    snapshot = torch.zeros(1, h, one.capacity)
    snapshot[0, :, :t] = snap
    mode.evict_held(one, snapshot, min(mode.observe, t))
    one.resize(one.budget)
    one.store.settle()
    return head
