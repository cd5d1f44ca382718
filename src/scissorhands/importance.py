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

from .state import TokenState


class ImportanceState(TokenState):
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

    wants_attention = True

    def __init__(self, form: str, bucket_steps: int | None, n_buckets: int):
        self.form = form
        self.bucket_steps = bucket_steps
        self.n_buckets = n_buckets
        self.reset()  # acc: (NB, B, H, cap) once allocated

    @classmethod
    def from_settings(cls, settings) -> ImportanceState:
        """The state a :class:`~scissorhands.config.CacheSettings` describes."""
        return cls(settings.importance, settings.bucket_steps(), settings.n_buckets())

    # -- storage -------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self._allocated

    def reset(self) -> None:
        self.acc = torch.empty(0, 0, 0, 0)
        self._allocated = False

    def allocate(self, batch: int, heads: int, capacity: int, group: int, device, dtype=torch.float32) -> None:
        """Allocate zeroed accumulators; counts use int16 when they cannot overflow it.

        ``sum`` accumulates in ``dtype`` promoted to at least float32.
        """
        if self.form == "sum":
            dtype = torch.promote_types(dtype, torch.float32)
        else:
            per_bucket = (self.bucket_steps or 2**31) * group
            dtype = torch.int16 if per_bucket < 2**15 else torch.int32
        self.acc = torch.zeros(self.n_buckets, batch, heads, capacity, dtype=dtype, device=device)
        self._allocated = True

    def grow(self, capacity: int) -> None:
        """Enlarge the token axis to ``capacity``, keeping the stored values."""
        old = self.acc
        nb, b, h, cap = old.shape  # (NB, B, H, cap)
        self.acc = old.new_zeros(nb, b, h, capacity)
        self.acc[..., :cap] = old

    def clear(self, start: int, end: int) -> None:
        """Zero slots ``[start, end)`` of every row: freshly appended tokens have no history."""
        self.acc[..., start:end] = 0

    def clear_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Zero the slots ``(rows[i], :, slots[i])`` (freshly appended tokens)."""
        self.acc[:, rows, :, slots] = 0

    # -- updates ---------------------------------------------------------------------------
    def observe(self, probs: torch.Tensor, attended, steps, valid: torch.Tensor | None) -> None:
        """Accumulate new queries' attention (see :meth:`TokenState.observe`)."""
        if isinstance(attended, int):  # decode: one query per row, all attended over the same slots
            contrib = probs.sum(dim=2) if self.form == "sum" else (probs > 1.0 / attended).sum(
                dim=2, dtype=torch.float32)  # (B, H_kv, n, L)
        else:
            contrib = self.contributions(probs, attended)
        if isinstance(steps, int):
            self.add_step(steps, contrib[:, :, 0])
        else:
            n = contrib.shape[2]
            self.add(steps, torch.ones(steps.shape[0], n, dtype=torch.bool) if valid is None else valid, contrib)

    def contributions(self, probs: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """What each query adds to each key, summed over the query heads of a group.

        Parameters
        ----------
        probs : Tensor, shape (B, H_kv, g, n, L)
            Attention probabilities of ``n`` queries over ``L`` slots; padding rows are 0.
        attended : Tensor, shape (B|1, 1, 1, n, 1)
            Number of tokens each query attended over (the ``count`` threshold is ``1/n``).

        Returns
        -------
        Tensor, shape (B, H_kv, n, L), in the accumulator's compute dtype
        """
        if self.form == "sum":
            return probs.sum(dim=2)  # (B, H_kv, n, L)
        return (probs > 1.0 / attended.clamp(min=1)).sum(dim=2, dtype=torch.float32)  # (B, H_kv, n, L)

    def add_step(self, step: int, contrib: torch.Tensor) -> None:
        """Fast path: one query per row, every row at the same ``step``. contrib: (B, H_kv, L)."""
        slot = 0
        if self.bucket_steps is not None:
            slot = (step // self.bucket_steps) % self.n_buckets
            if step % self.bucket_steps == 0:
                self.acc[slot].zero_()
        self.acc[slot, :, :, : contrib.shape[-1]] += contrib.to(self.acc.dtype)

    def add(self, steps: torch.Tensor, valid: torch.Tensor, contrib: torch.Tensor) -> None:
        """Accumulate a tile of queries whose steps may differ by row.

        Parameters
        ----------
        steps : LongTensor, shape (B, n), on the CPU
            Each query's step in its own sequence (real tokens seen before it).
        valid : BoolTensor, shape (B, n), on the CPU
            False for padding queries, which add nothing.
        contrib : Tensor, shape (B, H_kv, n, L)
            From :meth:`contributions`.

        Notes
        -----
        A tile may cross bucket boundaries, and even wrap the ring. Only the
        queries inside the window that ends at the tile's last query can still
        matter, so each row's update is: zero the ring slots of the buckets that
        start inside the tile, then add those queries' contributions to their
        slots. One einsum does the adding for all buckets at once.
        """
        nb = self.n_buckets
        b = steps.shape[0]
        if self.bucket_steps is None:
            weight = valid.to(torch.float32).unsqueeze(-1)  # (B, n, 1)
            restart = None
        else:
            s = self.bucket_steps
            big = torch.iinfo(torch.int64).max
            beta = steps // s  # (B, n) bucket ids
            last = torch.where(valid, steps, -1).amax(dim=1)  # (B,)
            first = torch.where(valid, steps, big).amin(dim=1)  # (B,)
            beta_last = last.div(s, rounding_mode="floor")  # (B,); -1 where a row has no valid query
            live = valid & (beta > (beta_last - nb)[:, None])  # (B, n)
            weight = torch.zeros(b, steps.shape[1], nb)
            weight.scatter_(2, (beta % nb).unsqueeze(-1), live.to(torch.float32).unsqueeze(-1))  # (B, n, NB)
            cand = beta_last[:, None] - torch.arange(nb)  # (B, NB) the window's bucket ids
            starts = cand * s
            fresh = (cand >= 0) & (starts >= first[:, None]) & (starts <= last[:, None])  # (B, NB)
            restart = torch.zeros(b, nb, dtype=torch.bool)
            restart.scatter_(1, cand % nb, fresh)  # (B, NB)
        device = self.acc.device
        length = contrib.shape[-1]
        if restart is not None and bool(restart.any()):
            keep = (~restart).T.to(device=device, dtype=self.acc.dtype)  # (NB, B)
            self.acc[..., :length] *= keep[:, :, None, None]
        delta = torch.einsum("bok,bhol->kbhl", weight.to(device=device, dtype=contrib.dtype), contrib)
        if self.acc.dtype.is_floating_point:
            self.acc[..., :length] += delta.to(self.acc.dtype)
        else:
            self.acc[..., :length] += delta.round().to(self.acc.dtype)

    # -- reads -----------------------------------------------------------------------------
    def scores(self, length: int) -> torch.Tensor:
        """Importance of the first ``length`` slots, shape (B, H_kv, length), float32."""
        return self.acc[..., :length].sum(dim=0, dtype=torch.float32)

    def compact(self, keep: torch.Tensor) -> None:
        """Reorder the first ``L`` slots by ``keep`` (kept slots first, in stored order).

        Parameters
        ----------
        keep : LongTensor, shape (B, H_kv, L)
        """
        order = keep
        k = order.shape[-1]
        idx = order.unsqueeze(0).expand(self.n_buckets, -1, -1, -1)  # (NB, B, H, L)
        self.acc[..., :k] = self.acc.gather(3, idx)

    def select_batch(self, index: torch.Tensor) -> None:
        self.acc = self.acc.index_select(1, index)

    def nbytes(self) -> int:
        return self.acc.numel() * self.acc.element_size()

    def bytes_per_token_head(self) -> int:
        """Bytes this state costs per stored token and KV head."""
        return self.n_buckets * self.acc.element_size() if self.allocated else 0
