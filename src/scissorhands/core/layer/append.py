"""New tokens written into a budgeted layer: every part it keeps aligned takes them at once.

:class:`Appending` is the part a :class:`~.budgeted.BudgetedKV` owns that writes tokens (``kv.appending``), as
:class:`~.eviction.Eviction` is the part that drops them: a block of a chunk (each row's real tokens after its
stored ones, padding skipped) or one aligned decode token. The store takes their K/V (and their positions, where
it wants them), the slot table their positions, every per-token state a fresh slot, and the tiers their count.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..stores.base import KVStore
from ..tokens.slots import SlotTable
from ..tokens.state import TokenState
from .demotion import Demotion


class Appended(Protocol):
    """What an append reads and changes of its layer (:class:`~.budgeted.BudgetedKV` is one)."""

    store: KVStore
    slots: SlotTable
    states: list[TokenState]
    demotion: Demotion | None

    @property
    def capacity(self) -> int: ...

    def reserve(self, needed: int, limit: int | None = None) -> None: ...


class Appending:
    """The writes of new tokens into one budgeted layer, a part it owns (``kv.appending``).

    Parameters
    ----------
    kv : Appended
        The layer it writes to.
    """

    def __init__(self, kv: Appended):
        self.kv = kv

    def block(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor | None, cum: torch.Tensor) -> None:
        """Write each row's real tokens of a block after its stored ones.

        key, value : (B, H_kv, c, D); valid : (B, c) bool or None (all real);
        cum : (B, c) CPU, real tokens of the block up to and including each index.
        """
        kv = self.kv
        slots = kv.slots
        added = cum[:, -1]  # (B,)
        kv.reserve(int((slots.lengths + added).max()))
        if valid is None and slots.aligned(slots.lengths):
            start, c = int(slots.lengths[0]), key.shape[-2]
            slots.place_block(start, c)
            if kv.store.wants_positions:
                kv.store.write(start, key, value, positions=slots.positions[:, 0, start : start + c])
            else:
                kv.store.write(start, key, value)
            for state in kv.states:
                state.clear(start, start + c)
        else:
            rows, cols = (valid if valid is not None else torch.ones_like(cum, dtype=torch.bool)).nonzero(as_tuple=True)
            where = slots.place_tokens(rows, cum, cols)
            r, sl, cl = rows.to(slots.device), where.to(slots.device), cols.to(slots.device)
            if kv.store.wants_positions:
                kv.store.write_at(r, sl, key[r, :, cl], value[r, :, cl], positions=slots.positions[r, 0, sl])
            else:
                kv.store.write_at(r, sl, key[r, :, cl], value[r, :, cl])  # (N, H_kv, D) each
            for state in kv.states:
                state.clear_slots(r, sl)
        slots.advance(added)
        if kv.demotion is not None:
            kv.demotion.added(added)

    def token(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """Decode fast path: one token per row, all rows aligned; return the new stored length."""
        kv = self.kv
        slots = kv.slots
        length, seen = slots.uniform  # type: ignore[misc]  # the caller checked that rows are aligned
        if length + 1 > kv.capacity:
            kv.reserve(length + 1)
        slots.positions[:, :, length] = seen
        if kv.store.wants_positions:
            kv.store.write(length, key, value, positions=slots.positions[:, 0, length : length + 1])
        else:
            kv.store.write(length, key, value)
        for state in kv.states:
            state.clear(length, length + 1)
        slots.advance_uniform()
        if kv.demotion is not None:
            kv.demotion.added(1)
        return length + 1
