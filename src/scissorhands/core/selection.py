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
    length = scores.shape[-1]
    device = scores.device
    score = scores.clone()
    slot = torch.arange(length, device=device)
    shielded = slot[None, :] >= (lengths.to(device) - recent)[:, None]  # (B, L): recent window and empty slots
    score.masked_fill_(shielded[:, None, :], float("inf"))
    if shield is not None:
        score.masked_fill_(shield, float("inf"))
    # Stable ascending sort: among equal scores the older slot comes first and goes first.
    order = torch.sort(score, dim=-1, stable=True).indices  # (B, H_kv, L)
    ranked_drop = slot[None, None, :] < n_drop.to(device)[:, None, None]  # (B, 1, L): rank < n_drop
    dropped = torch.zeros_like(score, dtype=torch.bool).scatter_(2, order, ranked_drop.expand_as(order))
    # Kept slots first, in stored order; dropped ones after.
    return torch.sort(dropped.to(torch.uint8), dim=-1, stable=True).indices  # (B, H_kv, L)
