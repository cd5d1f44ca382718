"""Per-token state that lives beside K/V: the extension point for methods that remember something.

A :class:`TokenState` keeps some numbers per stored slot (per row and KV head)
and is told everything that happens to the slots, so it can stay aligned with
K/V without the layer knowing what it holds. The layer calls, in order of a
token's life: :meth:`clear` (appended), :meth:`observe` (attended to),
:meth:`judged` (a held prompt was scored by its last queries), :meth:`compact`
(survived an eviction), and around them :meth:`allocate`, :meth:`resize`,
:meth:`select_batch` (beam reordering, batch expansion) and :meth:`reset`.
Every hook defaults to doing nothing, so a state overrides only what it needs.
"""

from __future__ import annotations

import torch


class TokenState:
    """Base class: per-slot state, moved with the same index as K/V."""

    wants_attention = False
    #: Whether :meth:`compact` takes ``rows`` (compacting only the rows that evict, in a ragged batch). A state
    #: that says False is handed the whole batch, with the identity order in the rows that keep everything.
    compacts_rows = False
    """Set True to receive attention probabilities in :meth:`observe` (they cost a little to hand over)."""

    @property
    def judged_replaces(self) -> bool:
        """Whether :meth:`judged` replaces all that a held prompt's queries left in this state, so that the
        prompt-aware prefill need not hand it their attention (only that of the queries that judge)."""
        return not self.wants_attention

    def allocate(self, batch: int, heads: int, capacity: int, group: int, device, dtype: torch.dtype) -> None:
        """First call of a sequence: ``group`` query heads share each of ``heads`` KV heads."""

    @property
    def allocated(self) -> bool:
        return True

    def resize(self, capacity: int) -> None:
        """The slot axis now has ``capacity`` slots (more, or fewer after a prompt-aware prefill); keep the rest."""

    def clear(self, start: int, end: int) -> None:
        """Slots ``[start, end)`` of every row now hold fresh tokens."""

    def clear_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Slot ``slots[i]`` of row ``rows[i]`` now holds a fresh token."""

    def observe(self, probs: torch.Tensor, attended, steps, valid: torch.Tensor | None) -> None:
        """New queries attended over the stored slots.

        Parameters
        ----------
        probs : Tensor, shape (B, H_kv, g, n, L)
            Attention probabilities of ``n`` queries (``g`` query heads per KV
            head) over the first ``L`` slots; padding queries are all zero.
        attended : int or Tensor of shape (B|1, 1, 1, n, 1)
            Number of tokens each query attended over.
        steps : int or LongTensor of shape (B, n), CPU
            Each query's step (real tokens its sequence saw before it); an int
            when every row is at the same step and ``n == 1``.
        valid : BoolTensor of shape (B, n), CPU, or None
            False for padding queries; None when all are real.
        """

    def judged(self, observed: torch.Tensor, watched: torch.Tensor, positions: torch.Tensor,
               seen: torch.Tensor) -> None:
        """A held prompt was judged by its last queries (the prompt-aware prefill), just before it is evicted
        down to the budget by that judgement.

        A state that ranks slots may replace what the prompt's queries left in it with the judgement, so that
        decoding goes on ranking the kept slots as the selection did.

        Parameters
        ----------
        observed : Tensor, shape (B, H_kv, L)
            The attention the watched queries paid each slot, summed over them and the query heads of a group
            (and max-pooled as the selection pools it).
        watched : Tensor, shape (B, H_kv, L)
            How many of the watched queries saw each slot; 0 in a row that had none (a chunk without its tokens).
        positions : Tensor, shape (B, H_kv, L)
            Each slot's position.
        seen : LongTensor, shape (B,)
            Tokens each row has seen (the prompt's end).
        """

    def compact(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Reorder the first ``L`` slots by ``keep`` (B, H_kv, L): kept slots first, in stored order.

        With ``rows`` (a device index), only those rows, and ``keep`` is (len(rows), H_kv, L).
        """

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (any order, repeats allowed)."""

    def load_row(self, row: int, other: TokenState, other_row: int, length: int) -> None:
        """Row ``row`` now holds what row ``other_row`` of ``other`` (a state of the same kind) holds in its first
        ``length`` slots, and nothing after them: a sequence that started elsewhere joins this batch.

        An engine that batches many sequences in one layer state (the vLLM adapter) needs it. Like every hook
        here it does nothing by default, which is right for a state that keeps nothing per slot.
        """

    def reset(self) -> None:
        """Forget everything (a new sequence starts)."""

    def nbytes(self) -> int:
        return 0

    def bytes_per_token_head(self) -> int:
        return 0
