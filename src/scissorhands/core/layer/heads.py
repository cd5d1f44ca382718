"""One layer's KV heads split into groups, each a :class:`~.budgeted.BudgetedKV` of its own budget.

Head-level budgets (``head_budgets``, :mod:`scissorhands.core.planning.heads`) give a layer's retrieval heads a
larger budget than its streaming heads. Each group of heads that share a budget is a whole budgeted layer over
those heads alone: its own store (only its heads' K/V, so the memory saved is real), slots, per-token state and
method. A chunk's queries are split by group (with GQA, query head ``q`` belongs to KV head ``q // g``), each
group attends through the one path every layer takes (:func:`~scissorhands.core.attend.streaming.attend`), and
the outputs go back in head order. Since heads evict independently, groups of equal budgets keep exactly what
one layer over all heads keeps.
"""

from __future__ import annotations

import torch

from ..attend.streaming import attend
from .budgeted import BudgetedKV
from .footprint import layer_memory


class HeadGroups:
    """A layer's KV heads in groups, each with its own budget.

    Parameters
    ----------
    groups : list of (heads, BudgetedKV)
        The KV heads of each group (ascending, together every head of the layer once) and the budgeted layer
        that holds them.
    """

    def __init__(self, groups: list[tuple[tuple[int, ...], BudgetedKV]]):
        heads = sorted(h for hs, _ in groups for h in hs)
        if heads != list(range(len(heads))):
            raise ValueError(f"head_budgets: the groups must hold every KV head once, got {[hs for hs, _ in groups]}")
        self.heads = [hs for hs, _ in groups]
        self.parts = [kv for _, kv in groups]
        self.n_heads = len(heads)
        self.layer_idx = self.parts[0].layer_idx
        self._query_heads: dict[int, list[tuple[int, ...]]] = {}  # per group size: each group's query heads

    # -- what the cache layer drives ---------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.parts[0].allocated

    @property
    def slots(self):
        """The first group's slot table: the rows and the tokens each has seen, which every group shares."""
        return self.parts[0].slots

    @property
    def budget(self) -> int:
        """The largest budget of any head: no head of this layer stores more."""
        return max(kv.budget for kv in self.parts)

    @property
    def state(self):
        """The per-token state of the group with the largest budget (the retrieval heads')."""
        return max(self.parts, key=lambda kv: kv.budget).state

    @property
    def compressions(self) -> int:
        return sum(kv.compressions for kv in self.parts)

    def head_budgets(self) -> list[int]:
        """Each KV head's budget, in head order."""
        out = [0] * self.n_heads
        for hs, kv in zip(self.heads, self.parts):
            for h in hs:
                out[h] = kv.budget
        return out

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage for each group, shaped after a first chunk (B, H_kv, T, D) of its heads."""
        for hs, kv in zip(self.heads, self.parts):
            kv.allocate(_take(key, hs), _take(value, hs))

    def reset(self) -> None:
        for kv in self.parts:
            kv.reset()

    def to_stored_order(self) -> None:
        for kv in self.parts:
            kv.to_stored_order()

    def select_batch(self, index: torch.Tensor) -> None:
        for kv in self.parts:
            kv.select_batch(index)

    def listen(self, listener) -> None:
        """Tell ``listener`` of every group's evictions, in the layer's head numbering."""
        for i, (hs, kv) in enumerate(zip(self.heads, self.parts)):
            kv.listeners.append(_InLayerHeads(listener, hs, self.n_heads, reorders=i == 0))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None, query_tile: int) -> torch.Tensor:
        """Each group's heads through :func:`~scissorhands.core.attend.streaming.attend`, outputs in head order.

        query : (B, H_q, T, D); key, value : (B, H_kv, T, D); returns (B, H_q, T, D_v).
        """
        b, h_q, t, _ = query.shape
        h = key.shape[1]
        if h != self.n_heads or h_q % h:
            raise ValueError(f"model: {h_q} query heads over {h} KV heads, but this layer was built for "
                             f"{self.n_heads} KV heads")
        g = h_q // h
        if g not in self._query_heads:  # the query heads of each group's KV heads, worked out once per model
            self._query_heads[g] = [tuple(k * g + j for k in hs for j in range(g)) for hs in self.heads]
        out = query.new_empty(b, h_q, t, value.shape[-1])  # (B, H_q, T, D_v)
        for hs, kv, q_heads in zip(self.heads, self.parts, self._query_heads[g]):
            done = attend(kv, _take(query, q_heads), _take(key, hs), _take(value, hs), mask, scaling, softcap,
                          query_tile)  # (B, len(q_heads), T, D_v)
            if _contiguous(q_heads):
                out[:, q_heads[0] : q_heads[-1] + 1] = done
            else:
                out[:, list(q_heads)] = done
        return out

    # -- what readers ask ---------------------------------------------------------------------------
    def held_per_head(self) -> torch.Tensor:
        """Tokens stored per row (B,), float, averaged over the layer's KV heads."""
        total = torch.zeros_like(self.parts[0].slots.lengths, dtype=torch.float64)  # (B,)
        for hs, kv in zip(self.heads, self.parts):
            total += len(hs) * kv.slots.lengths.double()
        return total / self.n_heads

    def stored_positions(self, row: int) -> torch.Tensor:
        """Positions stored for sequence ``row``, shape (H_kv, most stored), in stored order; -1 pads a head
        that stores fewer."""
        self.to_stored_order()
        rows = [kv.slots.row(row) for kv in self.parts]  # (heads of the group, stored) each
        width = max(r.shape[-1] for r in rows)
        out = rows[0].new_full((self.n_heads, width), -1)
        for hs, r in zip(self.heads, rows):
            out[list(hs), : r.shape[-1]] = r
        return out

    def memory(self) -> dict:
        """:func:`~.footprint.layer_memory` of every group, added up: bytes summed, ``budget``, ``stored`` and
        ``peak`` the most of any head, and ``head_budgets`` (each KV head's) and ``stored_mean`` (tokens stored
        per KV head, the most of any row) beside them."""
        parts = [layer_memory(kv) for kv in self.parts]
        out: dict = {"budget": self.budget, "head_budgets": self.head_budgets()}
        for key in ("stored", "peak", "capacity", "seen"):
            out[key] = max(p[key] for p in parts)
        for key in parts[0]:
            if key.endswith("_bytes"):
                out[key] = sum(p[key] for p in parts)
            elif key.endswith("_per_token_head"):
                out[key] = max(p[key] for p in parts)  # streaming heads keep no importance
        out["stored_mean"] = float(self.held_per_head().max()) if self.allocated else 0.0
        return out


class _InLayerHeads:
    """An eviction listener of one head group, told in the layer's head numbering (other heads drop nothing)."""

    def __init__(self, listener, heads: tuple[int, ...], n_heads: int, reorders: bool):
        self.listener, self.heads, self.n_heads, self.reorders = listener, list(heads), n_heads, reorders

    def evicted_tokens(self, layer_idx: int, seen, positions: torch.Tensor, scores: torch.Tensor,
                       dropped: torch.Tensor) -> None:
        b, _, length = dropped.shape  # (B, heads of the group, L)
        full_dropped = dropped.new_zeros(b, self.n_heads, length)  # (B, H_kv, L)
        full_positions = positions.new_full((b, self.n_heads, length), -1)
        full_scores = scores.new_zeros(b, self.n_heads, length)
        full_dropped[:, self.heads], full_positions[:, self.heads], full_scores[:, self.heads] = \
            dropped, positions, scores
        self.listener.evicted_tokens(layer_idx, seen, full_positions, full_scores, full_dropped)

    def select_batch(self, layer_idx: int, index: torch.Tensor) -> None:
        if self.reorders:  # once per layer, not once per group
            self.listener.select_batch(layer_idx, index)


def _contiguous(idx: tuple[int, ...]) -> bool:
    return idx == tuple(range(idx[0], idx[0] + len(idx)))


def _take(x: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    """``x[:, heads]`` (B, len(heads), ...): a view when the heads are consecutive."""
    if len(heads) == x.shape[1]:
        return x
    return x[:, heads[0] : heads[-1] + 1] if _contiguous(heads) else x[:, list(heads)]
