"""Which stored tokens an eviction keeps: one pure function, shared by every method."""

from __future__ import annotations

import torch


def keep_order(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    recent: int,
    n_drop: torch.Tensor,
    shield: torch.Tensor | None = None,
) -> torch.Tensor:
    """Permutation of each row's slots that puts the kept ones first.

    The ``n_drop[b]`` lowest-scoring slots of row ``b`` (per KV head) are
    dropped. The ``recent`` newest stored tokens of a row, its empty slots, and
    any slot in ``shield`` are never dropped. Among equal scores the older slot
    goes first, so ties keep the more recent token.

    Parameters
    ----------
    scores : Tensor, shape (B, H_kv, L)
        Keep-worthiness of each slot; higher means keep.
    lengths : LongTensor, shape (B,)
        Tokens stored per row (slots ``>= lengths[b]`` are empty).
    recent : int
        Size of the protected recent window.
    n_drop : LongTensor, shape (B,)
        Tokens to drop per row (0 for rows that do not compress).
    shield : BoolTensor, shape (B, H_kv, L) or broadcastable, optional
        Further slots that must stay (protected spans).

    Returns
    -------
    LongTensor, shape (B, H_kv, L)
        Slot indices: the kept slots in stored order, then the dropped ones.
    """
    dropped = lowest(scores, lengths, recent, n_drop, shield)
    length = scores.shape[-1]
    if length and _one_at_most(n_drop):
        # One slot d per row and head: the others keep their order and d goes last (what the sort below gives).
        slot = torch.arange(length, device=dropped.device)
        d = torch.where(dropped.any(-1), dropped.to(torch.uint8).argmax(-1), length - 1)[..., None]  # (B, H_kv, 1)
        order = slot + (slot >= d).long()  # (B, H_kv, L): every slot after d moves up one
        order[..., -1:] = d
        return order
    # Kept slots first, in stored order; dropped ones after.
    return torch.sort(dropped.to(torch.uint8), dim=-1, stable=True).indices  # (B, H_kv, L)


def _one_at_most(n: torch.Tensor) -> bool:
    """Whether no row drops more than one slot (a decode step with ``drop=1``, as in the vLLM adapter)."""
    return n.numel() == 0 or int(n.max()) <= 1


def lowest(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    recent: int,
    n: torch.Tensor,
    shield: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which slots are the ``n[b]`` lowest-scoring of row ``b`` (B, H_kv, L) bool, by the rules of :func:`keep_order`.

    ``n`` is (B,), or (B, H_kv) for a count per KV head.

    The recent window, empty slots and ``shield`` are never chosen (while
    there are enough other slots); among equal scores the older slot is chosen.
    """
    length = scores.shape[-1]
    device = scores.device
    score = scores.clone()
    slot = torch.arange(length, device=device)
    shielded = slot[None, :] >= (lengths.to(device) - recent)[:, None]  # (B, L): recent window and empty slots
    score.masked_fill_(shielded[:, None, :], float("inf"))
    if shield is not None:
        score.masked_fill_(shield, float("inf"))
    if length and _one_at_most(n):
        # One slot at most: the first minimum is the older of equal scores, as in the stable sort below.
        pick = score.argmin(dim=-1, keepdim=True)  # (B, H_kv, 1)
        wanted = (n[:, None] if n.dim() == 1 else n).to(device).bool()[..., None]  # (B, 1 or H_kv, 1)
        return torch.zeros_like(score, dtype=torch.bool).scatter_(2, pick, wanted.expand_as(pick))
    # Stable ascending sort: among equal scores the older slot comes first and goes first.
    order = torch.sort(score, dim=-1, stable=True).indices  # (B, H_kv, L)
    n = n.to(device)
    ranked = slot[None, None, :] < (n[:, None, None] if n.dim() == 1 else n[:, :, None])  # (B, 1 or H_kv, L)
    return torch.zeros_like(score, dtype=torch.bool).scatter_(2, order, ranked.expand_as(order).contiguous())
