"""Bounded importance state: a ring of step buckets per stored token and KV head.

An exact ``w``-step history window needs ``w`` numbers per token per head
(one per query step), which at ``w = 400`` outweighs the K/V themselves. Here
steps are grouped into buckets of ``s`` consecutive steps and the state keeps
one accumulator per bucket: ``n_buckets = ceil(w / s)`` numbers per token per
head. A token's importance is the sum over the ring, which covers every step
of the current (partial) bucket and of the ``n_buckets - 1`` buckets before
it: between ``w - s + 1`` and ``w`` steps. With ``s = 1`` this is the exact
window. An unbounded window (``w = None``) is one bucket that is never reset.
"""

from __future__ import annotations

import torch


class ImportanceState:
    """Per-token importance accumulators, kept beside K/V and compacted with them.

    Parameters
    ----------
    form : {"sum", "count"}
        What a query contributes to a key: its probability, or 1 if the
        probability exceeded ``1/n``.
    bucket_steps : int or None
        Steps per bucket ``s``; ``None`` for an unbounded window.
    n_buckets : int
        Number of buckets in the ring.
    """

    def __init__(self, form: str, bucket_steps: int | None, n_buckets: int):
        self.form = form
        self.bucket_steps = bucket_steps
        self.n_buckets = n_buckets
        self.acc: torch.Tensor | None = None  # (NB, B, H, cap)

    # -- storage -------------------------------------------------------------------------
    def allocate(self, batch: int, heads: int, capacity: int, group: int, device) -> None:
        """Allocate zeroed accumulators; counts use int16 when they cannot overflow it."""
        if self.form == "sum":
            dtype = torch.float32
        else:
            per_bucket = (self.bucket_steps or 2**31) * group
            dtype = torch.int16 if per_bucket < 2**15 else torch.int32
        self.acc = torch.zeros(self.n_buckets, batch, heads, capacity, dtype=dtype, device=device)

    def grow(self, capacity: int) -> None:
        """Enlarge the token axis to ``capacity``, keeping the stored values."""
        old = self.acc
        nb, b, h, cap = old.shape  # (NB, B, H, cap)
        self.acc = old.new_zeros(nb, b, h, capacity)
        self.acc[..., :cap] = old

    def clear(self, start: int, end: int) -> None:
        """Zero the slots ``[start, end)``: freshly appended tokens have no history."""
        self.acc[..., start:end] = 0

    # -- updates ---------------------------------------------------------------------------
    def bucket_of(self, step: int) -> int:
        return 0 if self.bucket_steps is None else (step // self.bucket_steps) % self.n_buckets

    def starts_bucket(self, step: int) -> bool:
        return self.bucket_steps is not None and step % self.bucket_steps == 0

    def next_boundary(self, step: int) -> int | None:
        """First step after ``step`` that opens a new bucket (None: never)."""
        if self.bucket_steps is None:
            return None
        return (step // self.bucket_steps + 1) * self.bucket_steps

    def add(self, first_step: int, probs: torch.Tensor, attended: torch.Tensor) -> None:
        """Accumulate one tile of queries, all from the bucket of ``first_step``.

        Parameters
        ----------
        first_step : int
            Step of the tile's first query; the tile must not cross a bucket boundary.
        probs : Tensor, shape (B, H_kv, g, n, L), float
            Attention probabilities of the tile's ``n`` queries (``g`` query heads per
            KV head) over the first ``L`` stored slots. Rows of padding queries are 0.
        attended : Tensor, shape (B, 1, 1, n, 1)
            Number of tokens each query attended over (``count`` threshold ``1/n``).
        """
        slot = self.bucket_of(first_step)
        if self.starts_bucket(first_step):
            self.acc[slot].zero_()
        length = probs.shape[-1]
        if self.form == "sum":
            contrib = probs.sum(dim=(2, 3))  # (B, H_kv, L)
        else:
            contrib = (probs > 1.0 / attended.clamp(min=1)).sum(dim=(2, 3))  # (B, H_kv, L)
        self.acc[slot, :, :, :length] += contrib.to(self.acc.dtype)

    # -- reads -----------------------------------------------------------------------------
    def scores(self, length: int) -> torch.Tensor:
        """Importance of the first ``length`` slots, shape (B, H_kv, length), float32."""
        return self.acc[..., :length].sum(dim=0, dtype=torch.float32)

    def compact(self, keep: torch.Tensor) -> None:
        """Move the kept slots to the front, in order.

        Parameters
        ----------
        keep : LongTensor, shape (B, H_kv, k)
            Slot indices to keep, ascending along the last axis.
        """
        k = keep.shape[-1]
        idx = keep.unsqueeze(0).expand(self.n_buckets, -1, -1, -1)  # (NB, B, H, k)
        self.acc[..., :k] = self.acc.gather(3, idx)

    def select_batch(self, index: torch.Tensor) -> None:
        self.acc = self.acc.index_select(1, index)

    def nbytes(self) -> int:
        return 0 if self.acc is None else self.acc.numel() * self.acc.element_size()

    def bytes_per_token_head(self) -> int:
        """Bytes this state costs per stored token and KV head."""
        if self.acc is None:
            return 0
        return self.n_buckets * self.acc.element_size()
