"""Stream a chunk of new tokens through a budgeted layer and compute its attention.

The chunk is cut into blocks at the points where some row must compress (its
next real token would not fit the budget). Each block is one attention
computation over the row's stored slots plus the block's own tokens (causally),
so a chunk gives exactly what feeding its tokens one at a time would give. The
method's per-token state observes every query's probabilities.
"""

from __future__ import annotations

import torch

from .budgeted import BudgetedKV
from .kernel import attend_stored


def attend(kv: BudgetedKV, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, softcap: float | None = None, query_tile: int = 256) -> torch.Tensor:
    """Store a chunk in ``kv`` and return its attention output.

    Parameters
    ----------
    kv : BudgetedKV
        The layer's budgeted storage (allocated).
    query : Tensor, shape (B, H_q, T, D)
    key, value : Tensor, shape (B, H_kv, T, D)
    mask : Tensor of bool or float, shape (B, 1, T, T), or None
        The model's causal + padding mask over the chunk (True or 0 = attend).
    scaling : float
        Logit scale.
    softcap : float, optional
        Logit soft-capping (``tanh(x / c) * c``).
    query_tile : int
        Most queries scored at once.

    Returns
    -------
    Tensor, shape (B, H_q, T, D_v); padding queries get zeros.
    """
    b, h_q, total, d = query.shape  # (B, H_q, T, D)
    h = key.shape[1]
    if h_q % h:
        raise ValueError(f"model: {h_q} query heads cannot share {h} KV heads")
    g = h_q // h
    if not kv.states_ready:
        # Allocated here: a count state's dtype depends on the group size, a sum's on the compute dtype.
        for state in kv.states:
            if not state.allocated:
                state.allocate(b, h, kv.capacity, group=g, device=query.device, dtype=query.dtype)
        kv.states_ready = True
    if total == 1 and mask is None and kv.slots.uniform is not None:
        return _decode_step(kv, query, key, value, scaling, softcap)

    valid = None
    if mask is not None:
        last = mask[:, 0, -1, :]  # (B, T): what the chunk's last query may see
        last = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
        if not bool(last.all()):
            valid = last.cpu()
    cum = (torch.ones(b, total, dtype=torch.long) if valid is None else valid.long()).cumsum(dim=1)  # (B, T)

    q = query.reshape(b, h, g, total, d)  # (B, H_kv, g, T, D)
    out = query.new_empty(b, h, g, total, value.shape[-1])  # (B, H_kv, g, T, D_v)
    if kv.prefill == "prompt-aware" and kv.slots.length == 0 and int(cum[:, -1].max()) > kv.budget:
        _prompt_aware_prefill(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
        _settle(kv)
        return out.view(b, h_q, total, -1)
    lengths = kv.slots.lengths
    i = 0
    while i < total:
        before = cum[:, i - 1] if i > 0 else torch.zeros(b, dtype=torch.long)
        coming = cum[:, -1] - before  # real tokens left per row
        full = (kv.slots.lengths >= kv.budget) & (coming > 0)
        if bool(full.any()):
            kv.compress(full)
        lengths = kv.slots.lengths
        free = kv.budget - lengths  # (B,)
        # Block end: the first index at which some row would exceed its free space.
        over = (cum - before[:, None]) > free[:, None]  # (B, T)
        over[:, :i] = False
        stops = torch.where(over.any(dim=1), over.float().argmax(dim=1), total)
        e = int(stops.min())
        bcum = cum[:, i:e] - before[:, None]  # (B, c)
        bvalid = None if valid is None else valid[:, i:e]
        base = lengths.clone()
        kv.append(key[:, :, i:e], value[:, :, i:e], bvalid, bcum)
        _attend_block(kv, q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, bvalid, scaling, softcap, query_tile)
        i = e
    _settle(kv)
    return out.view(b, h_q, total, -1)


def _settle(kv: BudgetedKV) -> None:
    """The chunk's attention is done: the store may free what only its queries needed (see ``KVStore.settle``)."""
    settle = getattr(kv.store, "settle", None)  # stores written before the interface had it need nothing
    if settle is not None:
        settle()


def _decode_step(kv: BudgetedKV, query, key, value, scaling, softcap) -> torch.Tensor:
    """One new token per row, all rows in step: the per-token path, kept to a few tensor ops."""
    b, h_q, _, d = query.shape  # (B, H_q, 1, D)
    h = key.shape[1]
    if kv.slots.uniform_state()[0] >= kv.budget:
        kv.compress(torch.ones(b, dtype=torch.bool))
    seen = kv.slots.uniform_state()[1]  # compression keeps rows aligned
    length = kv.append_token(key, value)
    q = query.view(b, h, h_q // h, d)  # (B, H_kv, g, D)
    bias = None if kv.merge is None else kv.merge.bias(length)[:, :, None, :]  # (B, H_kv, 1, L)
    # probs (B, H_kv, g, L), ctx (B, H_kv, g, D_v)
    probs, ctx = attend_stored(q, kv.store, length, scaling, softcap, bias=bias, limits=length, ends=length)
    if kv.state.wants_attention:
        kv.state.observe(probs.unsqueeze(3), length, seen, None)  # (B, H_kv, g, 1, L)
    return ctx.view(b, h_q, 1, -1)


def _prompt_aware_prefill(kv: BudgetedKV, q, out, key, value, valid, cum, scaling, softcap, query_tile) -> None:
    """Hold the whole prompt, attend over it exactly, then evict down to the budget in one step.

    For methods that score by attention, the prompt's tokens are scored by the
    attention the prompt's last ``kv.observe`` queries pay them (summed over
    the query heads of a group), max-pooled over neighbouring slots so that a
    fact spanning several tokens stays whole; those last queries themselves are
    kept. Other methods (position or random based) score the held prompt their
    own way. Peak memory is the prompt's length; from the next token on the
    budget holds as usual.
    """
    b = q.shape[0]
    real = cum[:, -1]  # (B,) real tokens per row
    kv.reserve(int(real.max()), limit=int(real.max()))
    kv.append(key, value, valid, cum)
    watch = (cum > (real - kv.observe)[:, None]) & (valid if valid is not None else True)  # (B, T): last queries
    snap = torch.zeros(b, key.shape[1], kv.capacity, device=q.device)
    _attend_block(kv, q, out, torch.zeros(b, dtype=torch.long), cum, valid, scaling, softcap, query_tile, (watch, snap))
    length = kv.slots.length
    if kv.state.wants_attention:
        scores = snap[:, :, :length]  # (B, H_kv, L)
        pooled = torch.nn.functional.max_pool1d(scores.reshape(-1, 1, length), kernel_size=7, stride=1, padding=3)
        scores = pooled.view_as(scores).clone()
        last = kv.slots.positions[:, :, :length] >= (real - kv.observe).to(q.device)[:, None, None]  # (B, H_kv, L)
        # Above any attention score but below the shields (recent window, protected spans), which stay inf.
        scores.masked_fill_(last, torch.finfo(scores.dtype).max)
    else:
        scores = kv.method.score(kv.view())
    kv.evict(scores, (real - kv.budget).clamp(min=0))
    kv.resize(kv.budget)


def _attend_block(kv: BudgetedKV, q, out, base, cum, valid, scaling, softcap, query_tile, snap=None) -> None:
    """Queries of one block over each row's old slots plus the block's real tokens (causal).

    q : (B, H_kv, g, c, D); out : (B, H_kv, g, c, D_v), written in place;
    base : (B,) CPU stored lengths before the block; cum, valid : (B, c) CPU;
    snap : optional ((B, c) bool, (B, H_kv, capacity) float): add the marked queries' probabilities to the tensor.
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
        if not (aligned and n == 1) and lo < length:
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
            attended = limit.to(device=device, dtype=probs.dtype)[:, None, None, :, None]  # (B, 1, 1, n, 1)
            steps = kv.slots.seen[:, None] - (cum[:, -1:] - cum[:, a:e]) - 1  # (B, n) CPU
            qvalid = None if valid is None else valid[:, a:e]
            kv.state.observe(probs, attended, int(steps[0, 0]) if aligned and n == 1 else steps, qvalid)
        a = e
