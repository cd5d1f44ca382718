"""One budgeted layer driven as an engine drives it, with no framework: the core's tests' layer.

A :class:`~scissorhands.core.layer.budgeted.BudgetedKV` allocated from the first chunk, and each chunk of new
tokens through :func:`~scissorhands.core.attend.streaming.attend`; that is all the transformers adapter's
``ScissorhandsLayer.attend`` does (``tests/hf/test_layer.py`` holds the two equal), less transformers' layer API.
"""

from __future__ import annotations

import torch

from scissorhands.core.attend.streaming import attend
from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.methods.base import EvictionMethod
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.settings.config import DEFAULTS
from scissorhands.core.tokens.slots import SlotTable
from scissorhands.core.tokens.state import TokenState


class CoreLayer:
    """``BudgetedKV.checked(budget, recent, drop, method, state, layer_idx, **options)`` and the chunks through it.

    The arguments are ``ScissorhandsLayer``'s: ``method`` defaults to Scissorhands, ``query_tile`` is the most
    query rows scored at once, and ``options`` (``store``, ``sinks``, ``prefill``, ``protect``, ``decode``,
    ``rounds``, ``merge``) go to the layer.
    """

    def __init__(self, budget: int, recent: int, drop: int, state: TokenState | None = None,
                 method: EvictionMethod | None = None, query_tile: int = DEFAULTS.query_tile, layer_idx: int = 0,
                 **options):
        self.kv = BudgetedKV.checked(budget, recent, drop, method or Scissorhands(), state, layer_idx, **options)
        self.query_tile = query_tile

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """A chunk of new tokens (B, H, T, D) through the budget; storage is shaped after the first chunk."""
        if not self.kv.allocated:
            self.kv.allocate(key, value)
        return attend(self.kv, query, key, value, mask, scaling, softcap, self.query_tile)

    @property
    def keys(self) -> torch.Tensor | None:
        """The store's key buffer (as ``ScissorhandsLayer.keys``), or None before the first chunk."""
        return getattr(self.kv.store, "keys", None) if self.kv.allocated else None

    @property
    def budget(self) -> int:
        return self.kv.budget

    @property
    def slots(self) -> SlotTable:
        return self.kv.slots

    @property
    def state(self) -> TokenState:
        return self.kv.state

    @property
    def compressions(self) -> int:
        return self.kv.compressions

    def stored_positions(self, row: int) -> torch.Tensor:
        """Positions stored for sequence ``row``, shape (H_kv, stored), in stored order."""
        self.kv.to_stored_order()
        return self.kv.slots.row(row)
