"""Where a budgeted layer keeps K and V: a small interface, so packed low-bit storage fits beside dense.

The layer decides *which* slot holds which token; a store only keeps the
tensors. Its contract:

* slots are addressed per row and KV head; rows may hold different numbers of
  tokens (the layer tracks the lengths), and every row has the same capacity;
* ``write``/``write_at`` put new tokens into slots, once each (a packed store
  quantises a token when it is written and never again);
* ``reorder`` permutes the first ``L`` slots of every (row, head) by an index
  (compaction after an eviction); a packed store moves its packed bytes and
  their per-group scales with that index, without dequantising;
* ``read(length)`` returns dense K and V of the first ``length`` slots, in the
  compute dtype; ``read_keys``/``read_values`` return one span of slots, so
  that attention over a packed store dequantises at most ``read_tile`` slots
  at a time (``read_tile`` None: the store is dense and reads are views);
* ``resize`` grows the slots (geometrically, up to the budget), or shrinks
  them back to the budget after a prompt-aware prefill held a whole prompt;
* ``nbytes`` counts what is really allocated, scales and zero-points included;
* ``settle`` is called when a chunk's attention is done (a store may free
  what only that chunk's queries needed; nothing by default).

Ten methods are abstract: ``allocate``, ``reset``, ``capacity``, ``resize``,
``write``, ``write_at``, ``reorder``, ``read``, ``select_batch`` and ``nbytes``. The rest
have defaults: tile reads (``read_keys``/``read_values``, a slice of ``read``),
``settle``, ``tiered``, the parts of ``nbytes`` and ``bytes_per_token_head``,
the byte model ``bytes_for`` and ``from_settings``.

What a store can do beyond that is declared, never probed: ``read_tile``
(reads cost a copy, so attention reads that many slots at a time),
``residual`` (newest tokens of each row a query reads exact; only the
:class:`~.residual.ResidualStore` wrapper has any) and ``wants_positions``
(``write``/``write_at`` take each token's position as ``positions=``: the
packed store with rotary key centres). The methods a store must
have are abstract, so a store missing one fails when it is made, not at its
first eviction. Stores are registered by name (:mod:`scissorhands.core.stores`)
and built from the settings by ``from_settings``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


def gather_rows(t: torch.Tensor, order: torch.Tensor, rows: torch.Tensor | None, dim: int = 2) -> None:
    """Permute the first ``L`` slots of ``t`` by ``order``, in place.

    ``t`` is laid out as (..., B, H_kv, capacity, ...) with the slot axis at
    ``dim`` (K/V: (B, H_kv, capacity, D), dim 2; a bucketed state:
    (NB, B, H_kv, capacity), dim 3). ``rows`` None: every row, ``order``
    (B, H_kv, L). Otherwise only the rows ``rows`` (a device index) are read
    and written, with ``order`` (len(rows), H_kv, L): compacting a few rows of
    a ragged batch costs what those rows hold.
    """
    lead, trail = dim - 2, t.dim() - dim - 1
    idx = order.view((1,) * lead + tuple(order.shape) + (1,) * trail)
    idx = idx.expand(*t.shape[:lead], *order.shape, *t.shape[dim + 1:])
    where = (slice(None),) * lead + (slice(None) if rows is None else rows, slice(None), slice(0, order.shape[-1]))
    t[where] = t[where].gather(dim, idx)


class KVStore(ABC):
    """Interface of a K/V store; see the module docstring for the contract."""

    #: The registry key (``kv_store=NAME``).
    name: ClassVar[str] = "base"
    #: Most slots attention reads back at once; None when a read costs nothing (dense views).
    read_tile: int | None = None
    #: Newest tokens of each row a query reads exact (0: no residual; see :class:`~.residual.ResidualStore`).
    residual: int = 0
    #: Whether ``write``/``write_at`` must be given each token's position (``positions=``, (B, c) or (N,)).
    wants_positions: bool = False

    @classmethod
    def from_settings(cls, settings, key_center: torch.Tensor | None = None) -> KVStore:
        """The store for these :class:`~scissorhands.core.settings.config.CacheSettings`.

        ``key_center``: one layer's key centres.
        """
        return cls()

    @classmethod
    def bytes_for(cls, settings, shape, tokens: int) -> int | None:
        """The store's byte model: bytes one KV head of one layer holds with ``tokens`` slots, for these
        settings and a model of this ``shape`` (:class:`~scissorhands.core.planning.memory_target.Shape`), before any
        residual. A pure function, checked against what the store allocates (tests/core/test_memory_target.py);
        ``memory=`` chooses budgets by it. None: this store declares none (``memory=`` then refuses it)."""
        return None

    @property
    @abstractmethod
    def capacity(self) -> int: ...

    @abstractmethod
    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Empty storage shaped after a chunk ``key``/``value`` (B, H_kv, T, D)."""

    @abstractmethod
    def reset(self) -> None:
        """Hold nothing (nothing allocated): the layer forgets its sequence."""

    @abstractmethod
    def resize(self, capacity: int) -> None:
        """Set the number of slots per row to ``capacity``, keeping what the remaining slots hold."""

    @abstractmethod
    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Write a block (B, H_kv, c, D) at slots ``[start, start + c)`` of every row."""

    @abstractmethod
    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        """Write token ``i`` (key[i]: (H_kv, D)) at slot ``slots[i]`` of row ``rows[i]``."""

    @abstractmethod
    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Permute the first ``L`` slots of each (row, head) by ``order`` (B, H_kv, L).

        With ``rows`` (a device index), only those rows, and ``order`` is (len(rows), H_kv, L).
        """

    @abstractmethod
    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V of the first ``length`` slots, each (B, H_kv, length, D)."""

    def read_keys(self, start: int, end: int) -> torch.Tensor:
        """Dense keys of slots ``[start, end)``: (B, H_kv, end - start, D)."""
        return self.read(end)[0][:, :, start:]

    def read_values(self, start: int, end: int) -> torch.Tensor:
        """Dense values of slots ``[start, end)``: (B, H_kv, end - start, D_v)."""
        return self.read(end)[1][:, :, start:]

    def tiered(self):
        """The chain of bit widths this store demotes through (a :class:`~.tiered.TieredKVStore`), or None."""
        return None

    def settle(self) -> None:  # noqa: B027  (optional: most stores keep nothing per chunk)
        """A chunk's attention is done: free what only its queries needed (nothing, by default)."""

    @abstractmethod
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (any order, repeats allowed)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes allocated now."""

    def bytes_per_token_head(self) -> int:
        """Bytes one stored slot costs per KV head, K and V together: by default, what is allocated over the
        slots (a store with storage beside its slots, as the tiered store's pools, says its own)."""
        keys, _ = self.read(0)
        slots = keys.shape[0] * keys.shape[1] * self.capacity
        return self.nbytes() // slots if slots else 0

    # The parts of ``nbytes``: element data, per-group scales and zero-points, full-precision residual.
    def data_bytes(self) -> int:
        return self.nbytes()

    def scale_bytes(self) -> int:
        return 0

    def residual_bytes(self) -> int:
        return 0


class DenseKVStore(KVStore):
    """K and V in the model's dtype, each of shape (B, H_kv, capacity, D)."""

    name = "dense"

    @classmethod
    def bytes_for(cls, settings, shape, tokens: int) -> int:
        return tokens * (shape.head_dim_k + shape.head_dim_v) * shape.itemsize

    def __init__(self):
        self.reset()

    def allocate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        b, h, _, d = key.shape
        self.keys = key.new_empty(b, h, 0, d)
        self.values = value.new_empty(b, h, 0, value.shape[-1])

    def reset(self) -> None:
        self.keys = torch.empty(0, 0, 0, 0)  # (B, H_kv, capacity, D) once allocated
        self.values = torch.empty(0, 0, 0, 0)

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def resize(self, capacity: int) -> None:
        def resized(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros(*t.shape[:2], capacity, t.shape[-1])  # (B, H_kv, capacity, D)
            keep = min(capacity, t.shape[-2])
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self.keys, self.values = resized(self.keys), resized(self.values)

    def write(self, start: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        c = key.shape[-2]
        self.keys[:, :, start : start + c] = key
        self.values[:, :, start : start + c] = value

    def write_at(self, rows: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 positions: torch.Tensor | None = None) -> None:
        self.keys[rows, :, slots] = key
        self.values[rows, :, slots] = value

    def reorder(self, order: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        for t in (self.keys, self.values):
            gather_rows(t, order, rows)

    def read(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, :length], self.values[:, :, :length]

    def select_batch(self, index: torch.Tensor) -> None:
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes
