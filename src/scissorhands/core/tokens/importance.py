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

from ..stores.base import gather_rows
from .judgement import judge
from .state import TokenState


def tile_buckets(steps: torch.Tensor, valid: torch.Tensor, bucket_steps: int | None,
                 n_buckets: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which ring slot each query of a tile adds to, and which ring slots restart.

    A tile may cross bucket boundaries, and even wrap the ring. Only the
    queries inside the window that ends at the tile's last query can still
    matter: they add to the slot of their bucket, and the slots of buckets
    that start inside the tile are zeroed first.

    Parameters
    ----------
    steps, valid : (B, n) CPU
        Each query's step, and False for padding queries.
    bucket_steps : int or None
        Steps per bucket; None for one bucket that never restarts.
    n_buckets : int

    Returns
    -------
    weight : Tensor, shape (B, n, NB), float32
        1 where query ``i`` of row ``b`` adds to ring slot ``k``.
    restart : BoolTensor, shape (B, NB), or None
        Ring slots to zero before adding.
    """
    nb = n_buckets
    b = steps.shape[0]
    if bucket_steps is None:
        return valid.to(torch.float32).unsqueeze(-1), None  # (B, n, 1)
    s = bucket_steps
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
    return weight, restart


def ring_add(acc: torch.Tensor, steps: torch.Tensor, valid: torch.Tensor, contrib: torch.Tensor,
             bucket_steps: int | None, n_buckets: int) -> None:
    """Add a tile of queries whose steps may differ by row to the ring ``acc`` (NB, B, H_kv, capacity), in place.

    Parameters
    ----------
    steps : LongTensor, shape (B, n), on the CPU
        Each query's step in its own sequence (real tokens seen before it).
    valid : BoolTensor, shape (B, n), on the CPU
        False for padding queries, which add nothing.
    contrib : Tensor, shape (B, H_kv, n, L)
        What each query adds to each slot (:meth:`ImportanceState.contributions`).

    Notes
    -----
    Each row's ring slots that restart inside the tile are zeroed, then one
    einsum adds every query to its bucket (see :func:`tile_buckets`).
    """
    weight, restart = tile_buckets(steps, valid, bucket_steps, n_buckets)
    device = acc.device
    length = contrib.shape[-1]
    if restart is not None and bool(restart.any()):
        keep = (~restart).T.to(device=device, dtype=acc.dtype)  # (NB, B)
        acc[..., :length] *= keep[:, :, None, None]
    delta = torch.einsum("bok,bhol->kbhl", weight.to(device=device, dtype=contrib.dtype), contrib)
    if acc.dtype.is_floating_point:
        acc[..., :length] += delta.to(acc.dtype)
    else:
        acc[..., :length] += delta.round().to(acc.dtype)


def queries_in_window(positions: torch.Tensor, seen: torch.Tensor, bucket_steps: int | None,
                      n_buckets: int) -> torch.Tensor:
    """How many queries inside the window each stored token has been scored by.

    A token at position ``a`` was attended by the queries of steps ``a`` to
    ``now = seen - 1``; the ring holds the steps from the start of its oldest
    bucket. positions (B, H_kv, L), seen (B,) -> float32 (B, H_kv, L), at least 1.
    """
    now = (seen - 1).to(positions.device)[:, None, None]  # (B, 1, 1)
    if bucket_steps is None:
        start = torch.zeros_like(now)
    else:
        start = ((now // bucket_steps - n_buckets + 1) * bucket_steps).clamp(min=0)
    return (now - torch.maximum(positions.long(), start) + 1).clamp(min=1).to(torch.float32)


def per_query(scores: torch.Tensor, queries: torch.Tensor, form: str, mean_cap: int | None) -> torch.Tensor:
    """What a form ranks by: ``mean`` divides each sum by its queries, counted up to ``mean_cap``; others as they are.

    Capped, a token scored by more than ``mean_cap`` queries is ranked by its sum over ``mean_cap``: the plain
    mean (no cap) favours young tokens more as a sequence grows, and at 8,192 tokens and more the sum ranks old
    tokens better on some models and texts (docs/results.md, "A default at every length").
    scores, queries: (B, H_kv, L) -> (B, H_kv, L).
    """
    if form != "mean":
        return scores
    queries = queries.to(scores.dtype)
    return scores / (queries if mean_cap is None else queries.clamp(max=mean_cap))


class ImportanceState(TokenState):
    """Per-token importance accumulators, kept beside K/V and compacted with them.

    Parameters
    ----------
    form : {"sum", "count", "mean"}
        What a query contributes to a key: its probability (``sum``, and
        ``mean``, which divides by the number of queries when scoring), or 1
        if the probability exceeded ``1/n`` (``count``).
    bucket_steps : int or None
        Steps per bucket ``s``; ``None`` for an unbounded window.
    n_buckets : int
        Number of buckets in the ring.
    value_weighted : bool
        Read by the scoring method: weigh importance by the value norm.
    mean_cap : int or None
        ``mean``: the queries are counted up to this many (:func:`per_query`).
    """

    wants_attention = True
    compacts_rows = True

    def __init__(self, form: str, bucket_steps: int | None, n_buckets: int, value_weighted: bool = False,
                 mean_cap: int | None = None):
        self.form = form
        self.mean_cap = mean_cap
        self.value_weighted = value_weighted
        self.bucket_steps = bucket_steps
        self.n_buckets = n_buckets
        self.reset()  # acc: (NB, B, H, cap) once allocated

    @classmethod
    def from_settings(cls, settings) -> ImportanceState:
        """The state a :class:`~scissorhands.core.settings.config.CacheSettings` describes."""
        return cls(settings.importance, settings.bucket_steps(), settings.n_buckets(), settings.value_weighted,
                   settings.mean_cap)

    @property
    def judged_replaces(self) -> bool:
        """``sum`` and ``mean`` take the judgement as each held slot's whole history; a ``count`` keeps its own."""
        return self.form != "count"

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
        if self.form != "count":
            dtype = torch.promote_types(dtype, torch.float32)
        else:
            per_bucket = (self.bucket_steps or 2**31) * group
            dtype = torch.int16 if per_bucket < 2**15 else torch.int32
        self.acc = torch.zeros(self.n_buckets, batch, heads, capacity, dtype=dtype, device=device)
        self._allocated = True

    def over(self, acc: torch.Tensor) -> ImportanceState:
        """A state of the same settings over accumulators held elsewhere, ``acc`` of shape (NB, B, H, capacity),
        shared, not copied: how an engine that keeps its own accumulators (the vLLM adapter) lets a method score
        them."""
        if acc.dim() != 4 or acc.shape[0] != self.n_buckets:
            raise ValueError(f"acc: expected shape ({self.n_buckets}, B, H, capacity), got {tuple(acc.shape)}")
        state = type(self)(self.form, self.bucket_steps, self.n_buckets, self.value_weighted, self.mean_cap)
        state.acc = acc
        state._allocated = True
        return state

    def resize(self, capacity: int) -> None:
        """Set the token axis to ``capacity``, keeping the values of the slots that remain."""
        old = self.acc
        nb, b, h, cap = old.shape  # (NB, B, H, cap)
        keep = min(cap, capacity)
        self.acc = old.new_zeros(nb, b, h, capacity)
        self.acc[..., :keep] = old[..., :keep]

    def clear(self, start: int, end: int) -> None:
        """Zero slots ``[start, end)`` of every row: freshly appended tokens have no history."""
        self.acc[..., start:end] = 0

    def clear_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Zero the slots ``(rows[i], :, slots[i])`` (freshly appended tokens)."""
        self.acc[:, rows, :, slots] = 0

    # -- updates ---------------------------------------------------------------------------
    def observe(self, probs: torch.Tensor, attended, steps, valid: torch.Tensor | None) -> None:
        """Accumulate new queries' attention (see :meth:`TokenState.observe`)."""
        if self.bucket_steps is None and self.form != "count" and not isinstance(steps, int):
            # One bucket (no window): every query of the tile adds to it, and padding queries' probabilities
            # are already 0, so one sum over the group and the queries replaces per-query rows and their routing.
            self.acc[0, :, :, : probs.shape[-1]] += probs.sum(dim=(2, 3)).to(self.acc.dtype)
            return
        if isinstance(attended, int):  # decode: one query per row, all attended over the same slots
            contrib = probs.sum(dim=2) if self.form != "count" else (probs > 1.0 / attended).sum(
                dim=2, dtype=torch.float32)  # (B, H_kv, n, L)
        else:
            contrib = self.contributions(probs, attended)
        if isinstance(steps, int):
            self.add_step(steps, contrib[:, :, 0])
        else:
            n = contrib.shape[2]
            self.add(steps, torch.ones(steps.shape[0], n, dtype=torch.bool) if valid is None else valid, contrib)

    def judged(self, observed: torch.Tensor, watched: torch.Tensor, positions: torch.Tensor,
               seen: torch.Tensor) -> None:
        """Replace the held prompt's history by the judgement of its last queries (see :meth:`TokenState.judged`),
        so that decoding ranks the kept tokens as the selection did (:func:`.judgement.judge` says how, per form)."""
        judge(self, observed, watched, positions, seen)

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
        if self.form != "count":
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
        """Accumulate a tile of queries whose steps may differ by row (:func:`ring_add`): ``steps``, ``valid``
        (B, n) CPU, each query's step and False for padding; ``contrib`` (B, H_kv, n, L) from :meth:`contributions`."""
        ring_add(self.acc, steps, valid, contrib, self.bucket_steps, self.n_buckets)

    # -- reads -----------------------------------------------------------------------------
    def scores(self, length: int) -> torch.Tensor:
        """Accumulated importance of the first ``length`` slots, shape (B, H_kv, length), float32 or wider."""
        return self.acc[..., :length].sum(dim=0, dtype=torch.promote_types(self.acc.dtype, torch.float32))

    def queries_in_window(self, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """How many queries inside the window each stored token has been scored by (see :func:`queries_in_window`)."""
        return queries_in_window(positions, seen, self.bucket_steps, self.n_buckets)

    def ranked(self, scores: torch.Tensor, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """``scores`` (:meth:`scores`) in what this form ranks by (:func:`per_query`)."""
        if self.form != "mean":
            return scores
        return per_query(scores, self.queries_in_window(positions, seen), self.form, self.mean_cap)

    def compact(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Reorder the first ``L`` slots by ``keep`` (kept slots first, in stored order).

        Parameters
        ----------
        keep : LongTensor, shape (B, H_kv, L), or (len(rows), H_kv, L) with ``rows``
        rows : LongTensor, optional
            Only these rows (a device index).
        """
        gather_rows(self.acc, keep, rows, dim=3)  # acc: (NB, B, H, capacity)

    def select_batch(self, index: torch.Tensor) -> None:
        self.acc = self.acc.index_select(1, index)

    def load_row(self, row: int, other: TokenState, other_row: int, length: int) -> None:
        assert isinstance(other, ImportanceState) and other.acc.dtype == self.acc.dtype
        self.acc[:, row] = 0
        self.acc[:, row, :, :length] = other.acc[:, other_row, :, :length]

    def nbytes(self) -> int:
        return self.acc.numel() * self.acc.element_size()

    def bytes_per_token_head(self) -> int:
        """Bytes this state costs per stored token and KV head."""
        return self.n_buckets * self.acc.element_size() if self.allocated else 0
