"""The queries of one block over each row's stored slots plus the block's own tokens, tile by tile.

Shared by every prefill strategy (:mod:`.prefill`): it computes the block's
attention output in place, lets the method's state observe each tile with each
query's own step, and can add marked queries' probabilities to a snapshot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layer.kernel import attend_stored

if TYPE_CHECKING:
    from ..layer.budgeted import BudgetedKV


def attend_block(kv: BudgetedKV, q, out, base, cum, valid, scaling, softcap, query_tile, snap=None,
                 leave: torch.Tensor | None = None) -> None:
    """Queries of one block over each row's old slots plus the block's real tokens (causal).

    q : (B, H_kv, g, c, D); out : (B, H_kv, g, c, D_v), written in place;
    base : (B,) CPU stored lengths before the block; cum, valid : (B, c) CPU;
    snap : optional ((B, c) bool, (B, H_kv, capacity) float): add the marked queries' probabilities to the tensor;
    leave : optional (B, H_kv, L) int, the block's query at which each slot leaves (a round's victims, see
    :meth:`.prefill.Streamed`): query ``j`` no longer sees a slot whose ``leave <= j``, and every query's count of
    attended slots is one less per victim gone (exactly one leaves per query, as one evicted per new token).
    """
    b, h, g, c, d = q.shape
    track = kv.state.wants_attention
    aligned = valid is None and kv.slots.aligned(base)
    device = q.device
    a = 0
    while a < c:
        e = min(c, a + query_tile)
        n = e - a
        limit = base[:, None] + cum[:, a:e]  # (B, n) slots each query sees
        length = int(limit.max())
        qt = q[:, :, :, a:e].reshape(b, h, g * n, d)  # (B, H_kv, g*n, D)
        allowed = None
        lo = int(limit.min())  # every query of the tile sees all slots before this one: only the rest is masked
        if leave is not None:  # a round's victims leave one per query, wherever they are stored
            lo = 0
            slot = torch.arange(length, device=device)
            seen_by = slot < limit.to(device)[:, :, None]  # (B, n, L)
            here = torch.arange(a, e, device=device)[None, None, :, None]  # (1, 1, n, 1)
            allowed = seen_by[:, None, None] & (leave[:, :, None, None, :length] > here[:, :, None])  # (B,H,1,n,L)
        elif not (aligned and n == 1) and lo < length:
            slot = torch.arange(lo, length, device=device)
            allowed = (slot < limit.to(device)[:, :, None])[:, None, None]  # (B, 1, 1, n, L - lo)
        bias = None if kv.merge is None else kv.merge.bias(length)[:, :, None, None, :]  # (B, H_kv, 1, 1, L)
        weight = None if valid is None else valid[:, a:e].to(device=device, dtype=torch.float32)
        # probs (B, H_kv, g, n, L); ctx (B, H_kv, g*n, D_v)
        probs, ctx = attend_stored(qt, kv.store, length, scaling, softcap, allowed, shape=(b, h, g, n, length),
                                   bias=bias, mask_from=lo,
                                   query_weight=None if weight is None else weight[:, None, None, :, None],
                                   limits=limit, ends=kv.slots.lengths)
        out[:, :, :, a:e] = ctx.view(b, h, g, n, -1)
        if snap is not None:
            marked = snap[0][:, a:e].to(device=device, dtype=probs.dtype)[:, None, None, :, None]  # (B, 1, 1, n, 1)
            snap[1][:, :, :length] += (probs * marked).sum(dim=(2, 3))
        if track:
            visible = limit if leave is None else limit - torch.arange(a + 1, e + 1)[None, :]  # victims gone
            attended = visible.to(device=device, dtype=probs.dtype)[:, None, None, :, None]  # (B, 1, 1, n, 1)
            steps = kv.slots.seen[:, None] - (cum[:, -1:] - cum[:, a:e]) - 1  # (B, n) CPU
            qvalid = None if valid is None else valid[:, a:e]
            one = aligned and n == 1 and leave is None
            kv.state.observe(probs, attended, int(steps[0, 0]) if one else steps, qvalid)
        a = e
