"""The attention arithmetic shared by the decode path and the block path.

Probabilities are computed explicitly (not through a fused kernel) because
eviction needs them; logits are taken in at least float32.
"""

from __future__ import annotations

import math

import torch

from ..stores.residual import ResidualStore


def attention_probs(
    q: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    allowed: torch.Tensor | None = None,
    shape: tuple[int, ...] | None = None,
    bias: torch.Tensor | None = None,
    mask_from: int = 0,
) -> torch.Tensor:
    """Softmax of scaled (and optionally soft-capped) ``q @ keys^T``.

    Parameters
    ----------
    q : Tensor, shape (B, H_kv, M, D)
        ``M`` query rows per KV head (the query heads of a group, times queries).
    keys : Tensor, shape (B, H_kv, L, D)
    scaling : float
    softcap : float, optional
        ``tanh(x / c) * c`` on the logits.
    allowed : BoolTensor, optional
        Broadcastable to the logits (after ``shape``); False slots get no attention.
    shape : tuple of int, optional
        View the (B, H_kv, M, L) logits as this shape before masking, e.g. (B, H_kv, g, n, L).
    bias : Tensor, optional
        Added to the scaled logits (broadcastable), e.g. the log-mass of merged slots.
    mask_from : int
        The caller's promise that ``allowed`` is True in every slot before
        this one; only the slots from here on are masked (``allowed`` may
        cover all ``L`` slots or only these).

    Returns
    -------
    Tensor, shape (B, H_kv, M, L) or ``shape``, float32 or wider

    Notes
    -----
    One pass over the logits per step, each in place on the matmul's own
    output. A power-of-two ``scaling`` (1/8 for head_dim 64) is folded into
    the queries instead: scaling by a power of two is exact in floating point,
    so the logits are bitwise the same and the pass over them is saved.
    """
    exact = _exact_scale(q, scaling)
    logits = torch.matmul(q * scaling if exact else q, keys.transpose(-1, -2))  # (B, H_kv, M, L), a new tensor
    if shape is not None:
        logits = logits.view(shape)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # a new tensor only when it widens
    return _softmax(logits, scaling, exact, softcap, allowed, bias, mask_from)


def _exact_scale(q: torch.Tensor, scaling: float) -> bool:
    """Whether ``scaling`` is a power of two, so that it can be folded into the queries exactly."""
    return scaling > 0 and math.frexp(scaling)[0] == 0.5 and q.dtype.is_floating_point


def _softmax(logits: torch.Tensor, scaling: float, exact: bool, softcap, allowed, bias, mask_from: int) -> torch.Tensor:
    """Finish float32 ``q @ keys^T`` logits in place: scale, cap, bias, mask, softmax."""
    if not exact:
        logits.mul_(scaling)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if bias is not None:
        logits = logits + bias
    if allowed is not None:
        if allowed.shape[-1] != logits.shape[-1] - mask_from:
            allowed = allowed[..., mask_from:]
        logits[..., mask_from:].masked_fill_(~allowed, torch.finfo(logits.dtype).min)
    return torch.softmax(logits, dim=-1, out=logits)


def attention_output(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``probs @ values`` in the values' dtype: (B, H_kv, M, L) x (B, H_kv, L, D_v) -> (B, H_kv, M, D_v)."""
    return torch.matmul(probs.to(values.dtype), values)


def attend_stored(
    q: torch.Tensor,
    store,
    length: int,
    scaling: float,
    softcap: float | None = None,
    allowed: torch.Tensor | None = None,
    shape: tuple[int, ...] | None = None,
    bias: torch.Tensor | None = None,
    mask_from: int = 0,
    query_weight: torch.Tensor | None = None,
    limits: int | torch.Tensor | None = None,
    ends: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` (B, H_kv, M, D) over the first ``length`` slots of a K/V store.

    Returns the probabilities (as :func:`attention_probs`, viewed as ``shape``)
    and the output (B, H_kv, M, D_v) in the values' dtype. ``query_weight``,
    broadcastable to the probabilities, multiplies them before the output
    (zeros for padding queries); the returned probabilities include it.

    A dense store is read whole (its reads are views). A packed store is read
    ``store.read_tile`` slots at a time, twice: key tiles fill the float32
    logits, the softmax runs over the whole row (eviction needs every
    probability anyway), then value tiles are dequantised one at a time and
    their products summed. So no more than one tile of K or V is ever dense.

    A residual store (:class:`~..stores.residual.ResidualStore`, R = ``store.residual``) needs ``limits``, the
    slots each query sees (an int for all, or (B, n) for the ``n`` queries of
    ``shape`` = (B, H_kv, g, n, L)), and ``ends``, each row's stored length:
    a query that sees ``limit`` slots reads slots ``[limit - R, limit)`` exact
    and the ones before packed, as it would have when it was decoded alone.
    """
    if isinstance(store, ResidualStore) and limits is not None:
        if ends is None:
            if not isinstance(limits, int):
                raise ValueError("ends: per-query limits need each row's stored length")
            ends = limits
        return _attend_residual(q, store, length, scaling, softcap, allowed, shape, bias, mask_from, query_weight,
                                limits, ends)
    tile = store.read_tile
    mask = (softcap, allowed, shape, bias, mask_from, query_weight)
    if tile is None or length <= tile:
        keys, values = store.read(length)
        return _one_read(q, keys, values, scaling, *mask)
    qs, exact, logits = _logits_row(q, scaling, length)
    for start in range(0, length, tile):
        end = min(length, start + tile)
        logits[..., start:end] = torch.matmul(qs, store.read_keys(start, end).transpose(-1, -2))
    probs, flat = _probs(logits, q, scaling, exact, *mask)
    out = None
    for start in range(0, length, tile):
        end = min(length, start + tile)
        values = store.read_values(start, end)  # (B, H_kv, tile, D_v), the only dense copy alive
        out = _accumulate(out, flat[..., start:end], values)
    assert out is not None
    return probs, out.to(values.dtype)


def _attend_residual(q, store: ResidualStore, length, scaling, softcap, allowed, shape, bias, mask_from,
                     query_weight, limits, ends) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_stored` over a store whose newest ``R`` tokens per query are read exact.

    Slots below ``x_lo`` are packed for every query of the tile and slots from
    ``x_hi`` on are exact for every query that sees them; in between (at most
    the tile's spread of limits), each query takes its own choice, so both
    forms are scored there and the probabilities are split between the two
    value reads.
    """
    r = store.residual
    lo, hi = (limits, limits) if isinstance(limits, int) else (int(limits.min()), int(limits.max()))
    x_lo, x_hi = min(length, max(0, lo - r)), min(length, max(0, hi - r))
    tile = store.read_tile or max(length, 1)
    mask = (softcap, allowed, shape, bias, mask_from, query_weight)
    if x_lo == x_hi and length <= tile:
        # Every query splits at the same slot (decoding): the packed keys, then the exact ones, as one dense
        # tile. The values are two products summed as the general path below sums them, so that in bf16 a
        # decoded step and a blocked one round alike.
        keys = store.read_exact_keys(x_hi, length, ends)
        if x_hi:
            keys = torch.cat([store.read_keys(0, x_hi), keys], dim=2)
        probs = attention_probs(q, keys, scaling, softcap, allowed, shape, bias, mask_from)
        if query_weight is not None:
            probs = probs * query_weight
        return probs, _residual_output(probs.view(*q.shape[:-1], length), store, x_lo, x_hi, tile, ends, None)
    device = q.device
    qs, exact, logits = _logits_row(q, scaling, length)
    for start in range(0, x_hi, tile):
        end = min(x_hi, start + tile)
        logits[..., start:end] = torch.matmul(qs, store.read_keys(start, end).transpose(-1, -2))
    exact_logits = torch.matmul(qs, store.read_exact_keys(x_lo, length, ends).transpose(-1, -2))  # (.., L - x_lo)
    choose = None  # (B, 1, M, x_hi - x_lo): the mixed slots each query reads exact
    if x_hi > x_lo:
        assert isinstance(limits, torch.Tensor)
        lim = limits.to(device)  # (B, n)
        b, n = lim.shape
        slot = torch.arange(x_lo, x_hi, device=device)
        mixed = slot[None, None, :] >= (lim - r)[:, :, None]  # (B, n, Z)
        g = q.shape[2] // n
        choose = mixed[:, None, None].expand(b, 1, g, n, x_hi - x_lo).reshape(b, 1, g * n, x_hi - x_lo)
        logits[..., x_lo:x_hi] = torch.where(choose, exact_logits[..., : x_hi - x_lo], logits[..., x_lo:x_hi])
    logits[..., x_hi:] = exact_logits[..., x_hi - x_lo:]
    probs, flat = _probs(logits, q, scaling, exact, *mask)
    return probs, _residual_output(flat, store, x_lo, x_hi, tile, ends, choose)


def _residual_output(flat, store, x_lo, x_hi, tile, ends, choose) -> torch.Tensor:
    """Probabilities ``flat`` (B, H_kv, M, L) times values: packed tiles below ``x_hi``, exact from ``x_lo``.

    ``choose`` (B, 1, M, x_hi - x_lo) says which query reads which mixed slot exact (None: no mixed slots);
    each mixed slot's probability goes to one of the two products, never both.
    """
    out = None
    for start in range(0, x_hi, tile):
        end = min(x_hi, start + tile)
        part = flat[..., start:end]
        if choose is not None and end > x_lo:
            a = max(start, x_lo)
            part = part.clone()
            part[..., a - start:].masked_fill_(choose[..., a - x_lo : end - x_lo], 0)
        out = _accumulate(out, part, store.read_values(start, end))
    exact = flat[..., x_lo:]
    if choose is not None:
        exact = exact.clone()
        exact[..., : x_hi - x_lo].masked_fill_(~choose, 0)
    values = store.read_exact_values(x_lo, flat.shape[-1], ends)
    return _accumulate(out, exact, values).to(values.dtype)


def _accumulate(out: torch.Tensor | None, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out + probs @ values``, the product taken in the values' dtype and summed in at least float32."""
    part = torch.matmul(probs.to(values.dtype), values)
    return part.to(torch.promote_types(part.dtype, torch.float32)) if out is None else out.add_(part)


def _one_read(q, keys, values, scaling, softcap, allowed, shape, bias, mask_from, query_weight):
    """Probabilities and output over dense ``keys``/``values`` (B, H_kv, L, ·) read at once."""
    probs = attention_probs(q, keys, scaling, softcap, allowed, shape, bias, mask_from)
    if query_weight is not None:
        probs = probs * query_weight
    return probs, attention_output(probs.view(*q.shape[:-1], keys.shape[-2]), values)


def _logits_row(q, scaling, length):
    """Queries with the scale folded in when exact, whether it was, and an empty logits row (B, H_kv, M, L)."""
    exact = _exact_scale(q, scaling)
    logits = torch.empty(*q.shape[:-1], length, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    return (q * scaling if exact else q), exact, logits


def _probs(logits, q, scaling, exact, softcap, allowed, shape, bias, mask_from, query_weight):
    """Softmax of a filled logits row (viewed as ``shape``), times ``query_weight``; and its (B, H_kv, M, L) view."""
    probs = _softmax(logits if shape is None else logits.view(shape), scaling, exact, softcap, allowed, bias,
                     mask_from)
    if query_weight is not None:
        probs = probs * query_weight
    return probs, probs.view(*q.shape[:-1], logits.shape[-1])
