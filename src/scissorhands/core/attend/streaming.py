"""Stream a chunk of new tokens through a budgeted layer and compute its attention.

A decode step (one token per row, rows aligned) takes a short path here. A
longer chunk goes to the layer's prefill strategy (:mod:`.prefill`): streamed
through the budget block by block, or held whole and evicted once. The
method's per-token state observes every query's probabilities.
"""

from __future__ import annotations

import torch

from ..layer.budgeted import BudgetedKV
from ..layer.kernel import attend_stored
from ..settings.config import DEFAULTS
from .prefill import Streamed

STREAMED = Streamed()


def attend(kv: BudgetedKV, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, softcap: float | None = None, query_tile: int = DEFAULTS.query_tile) -> torch.Tensor:
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
    if total == 1 and kv.static is not None and kv.static.ready() and (mask is None or _real(mask)):
        return kv.static.step(query, key, value, scaling, softcap)
    kv.to_stored_order()
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
    (kv.prefill or STREAMED).take(kv, q, out, key, value, valid, cum, scaling, softcap, query_tile)
    _settle(kv)
    return out.view(b, h_q, total, -1)


def _real(mask: torch.Tensor) -> bool:
    """Whether every row's one new token is real (it may see itself): then padding only hides stored tokens, which
    were never stored. The one read of the mask a padded batch costs the static step."""
    own = mask[:, 0, -1, -1]
    return bool(own.all()) if own.dtype == torch.bool else bool((own > torch.finfo(own.dtype).min / 2).all())


def _settle(kv: BudgetedKV) -> None:
    """The chunk's attention is done: the store may free what only its queries needed (see ``KVStore.settle``)."""
    kv.store.settle()


def _decode_step(kv: BudgetedKV, query, key, value, scaling, softcap) -> torch.Tensor:
    """One new token per row, all rows in step: the per-token path, kept to a few tensor ops."""
    b, h_q, _, d = query.shape  # (B, H_q, 1, D)
    h = key.shape[1]
    if kv.room_uniform() <= 0:
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


