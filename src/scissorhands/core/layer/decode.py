"""A decode step with fixed shapes and no host synchronisation: ``decode="static"``.

The default decode step (:func:`..attend.streaming._decode_step`) keeps each row's
slots compact and in stored order, and plans with Python integers: the stored
length is read on the host, an eviction runs only when a row is full, and
compaction gathers K/V into their new order. On a CPU that costs nothing. On
a GPU every read of a length is a host-device synchronisation, and every new
length is a new shape, so the step cannot be captured in one graph.

This step keeps the same tokens with a different layout:

* every buffer has the budget's capacity from the first step on;
* a slot is empty when its position is -1; no slot order is kept. An eviction
  marks its slots empty, and moves nothing;
* a new token goes to the first empty slot of its (row, KV head);
* a step at which some row is at its budget computes the eviction, and
  applies it only in the heads that are full (masks, never a branch on a
  tensor's value). The host knows which steps those are without reading the
  device, since a full row always evicts exactly ``drop`` tokens: so there are
  two graphs, a step that may evict and one that cannot, each of fixed shapes;
* the positions and the steps seen live in tensors on the device.

The rule is the layer's (:mod:`.budgeted`, :func:`..tokens.selection.lowest`): drop
the ``drop`` lowest-scoring tokens, never the ``recent`` newest ones, an empty
slot or a shielded one, and among equal scores the older token first. Since
slots are not in stored order here, "older" is read from the positions: the
candidates are sorted by position, then stably by score. The newest ``recent``
tokens are those at positions ``>= seen - recent``: the layer never evicts a
token while it is among the newest ``recent``, so all of them are stored.

The step reads a layer's own storage in place (the dense store's K/V, the
slot table's positions, the importance accumulators), resized to the budget
once. Before anything else reads the layer, :meth:`StaticDecode.settle` puts
the slots back in stored order, so every other path sees what the default
step would have left, up to float rounding: attention sums the same slots in
another order.

What it takes: a dense store, a method whose state is
:class:`~..tokens.importance.ImportanceState` (scissorhands, its count form, h2o,
tova), no merging, no tiers, and no listeners (an audit is told of every
eviction on the host). :func:`check_static` says why, in one line, when a
layer cannot.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import torch

from ..registry import Registry
from ..stores.base import DenseKVStore
from ..tokens.importance import ImportanceState, per_query, queries_in_window
from ..tokens.protect import in_spans
from .kernel import attention_output, attention_probs


class DecodeMode:
    """How a budgeted layer takes its one-token steps, chosen by the ``decode`` setting (a plug-in axis).

    :meth:`for_layer` returns the object that takes the layer's decode steps, or None for the layer's own
    compact step (``"dynamic"``). Such an object offers ``ready()`` (whether the next step can be its),
    ``step(query, key, value, scaling, softcap)`` (the attention output), ``settle()`` (the slots back in the
    layout every other path reads) and ``active`` (whether it holds the layer now); :class:`StaticDecode` is the
    shipped one. Register a new mode with :func:`register_decode` and select it by name.
    """

    name: ClassVar[str] = "base"

    @classmethod
    def for_layer(cls, kv):
        """The decode step of the layer ``kv`` (a one-line ``ValueError`` naming ``decode`` if it cannot serve)."""
        return cls(kv)


class Dynamic(DecodeMode):
    """The default: the layer's own step (:func:`..attend.streaming._decode_step`), slots planned on the host."""

    name = "dynamic"

    @classmethod
    def for_layer(cls, kv):
        return None


DECODES: Registry[type[DecodeMode]] = Registry("register_decode", DecodeMode, axis="decode")


def register_decode(cls: type[DecodeMode]) -> type[DecodeMode]:
    """Class decorator: make ``cls`` available as ``decode=cls.name``."""
    return DECODES.register(cls)


def unregister_decode(name: str) -> None:
    """Remove a registered decode mode (for tests and experiments)."""
    DECODES.unregister(name)


def make_decode(kv, name: str):
    """The decode step ``name`` gives the layer ``kv``, or None for the layer's own."""
    if name not in DECODES:
        raise ValueError(f"decode: unknown decode mode {name!r}; choose from {', '.join(DECODES)}")
    return DECODES[name].for_layer(kv)


def check_static(kv, mode: str = "static") -> None:
    """A one-line ``ValueError`` naming ``decode`` when the layer ``kv`` cannot take the static step."""
    why = None
    if type(kv.store) is not DenseKVStore:
        why = f"needs the dense K/V store, not {kv.store.name!r} (packed K/V reads tiles sized on the host)"
    elif kv.method.is_full:
        why = "the full cache evicts nothing; use decode='dynamic'"
    elif not isinstance(kv.state, ImportanceState):
        why = (f"method {kv.method.name!r} keeps no importance state; the static step serves scissorhands, "
               "scissorhands-count, h2o and tova")
    elif kv.merge is not None:
        why = "cannot be combined with merge"
    elif kv.tiers is not None:
        why = "cannot be combined with kv_demote"
    elif kv.state.value_weighted:
        why = "cannot be combined with value_weighted"
    if why is not None:
        raise ValueError(f"decode: {mode!r} {why}")


def static_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, acc: torch.Tensor,
                seen: torch.Tensor, spans: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, *, budget: int, recent: int, drop: int, form: str, bucket_steps: int | None,
                scaling: float, softcap: float | None, evict: bool = True,
                mean_cap: int | None = None) -> torch.Tensor:
    """One decode step of a budgeted layer, in place on its buffers; returns the attention output.

    Parameters
    ----------
    keys, values : Tensor, shape (B, H_kv, C, D)
        The stored K/V, C = ``budget`` slots, in no order.
    positions : IntTensor, shape (B, H_kv, C)
        Each slot's position, -1 when empty.
    acc : Tensor, shape (NB, B, H_kv, C)
        The importance accumulators (:class:`~..tokens.importance.ImportanceState`).
    seen : LongTensor, shape (B,)
        Tokens each row has seen: the new token's position. Advanced by one.
    spans : LongTensor, shape (R, S, 2), R in {1, B}, or None
        Shielded position spans ``[start, end)`` (sinks and protected spans).
    query : Tensor, shape (B, H_q, 1, D); key, value : (B, H_kv, 1, D)
    budget, recent, drop : int
        The layer's budget, recent window and drop amount.
    form : str
        The importance form, ``"sum"``, ``"mean"`` or ``"count"``.
    bucket_steps : int or None
        Steps per importance bucket (None: one bucket that never restarts).
    scaling, softcap : float
        Logit scale and soft-cap.
    evict : bool
        Whether any head may be at its budget. The host knows this without reading the device (a full row
        always evicts exactly ``drop``), so a step that cannot evict skips the selection: two graphs, each with
        fixed shapes. With True the eviction is applied only where a head is full.
    mean_cap : int or None
        ``"mean"``: the queries each sum is divided by are counted up to this many
        (:func:`~..tokens.importance.per_query`).

    Returns
    -------
    Tensor, shape (B, H_q, 1, D_v)
    """
    b, h, c, _ = keys.shape
    h_q = query.shape[1]
    nb = acc.shape[0]
    device = keys.device

    # 1. Evict where a head is at its budget: the same rule as selection.lowest, read by position.
    if evict:
        _evict(positions, acc, seen, spans, budget, recent, drop, form, bucket_steps, mean_cap)

    # 2. Write the new token into its (row, head)'s first empty slot.
    free = (positions < 0).to(torch.uint8)
    at = free.argmax(dim=-1, keepdim=True)  # (B, H_kv, 1): the first empty slot
    keys.scatter_(2, at[..., None].expand(b, h, 1, keys.shape[-1]), key)
    values.scatter_(2, at[..., None].expand(b, h, 1, values.shape[-1]), value)
    positions.scatter_(2, at, seen[:, None, None].expand(b, h, 1).to(positions.dtype))
    acc.scatter_(3, at[None].expand(nb, b, h, 1), 0)  # a fresh token has no history

    # 3. Attend over the stored slots.
    stored = positions >= 0
    q = query.view(b, h, h_q // h, query.shape[-1])  # (B, H_kv, g, D)
    probs = attention_probs(q, keys, scaling, softcap, allowed=stored[:, :, None, :])  # (B, H_kv, g, C)
    out = attention_output(probs, values)  # (B, H_kv, g, D_v)

    # 4. Observe: each query's attention, added to its step's bucket.
    if form == "count":
        attended = stored.sum(dim=-1, keepdim=True).to(probs.dtype)  # (B, H_kv, 1)
        contrib = (probs > 1.0 / attended[:, :, None]).sum(dim=2, dtype=torch.float32)  # (B, H_kv, C)
    else:
        contrib = probs.sum(dim=2)
    contrib = contrib.to(acc.dtype)
    if bucket_steps is None:
        acc[0] += contrib
    else:
        ring = torch.arange(nb, device=device)
        mine = ring[:, None] == ((seen // bucket_steps) % nb)[None, :]  # (NB, B): this step's bucket
        restart = mine & (seen % bucket_steps == 0)[None, :]
        acc.masked_fill_(restart[:, :, None, None], 0)
        acc.add_(torch.where(mine[:, :, None, None], contrib[None], 0).to(acc.dtype))
    seen.add_(1)
    return out.view(b, h_q, 1, -1)


def _evict(positions: torch.Tensor, acc: torch.Tensor, seen: torch.Tensor, spans: torch.Tensor | None, budget: int,
           recent: int, drop: int, form: str, bucket_steps: int | None, mean_cap: int | None) -> None:
    """Mark empty the ``drop`` lowest-scoring slots of every head at its budget (see :func:`static_step`)."""
    slot = torch.arange(positions.shape[-1], device=positions.device)
    stored = positions >= 0  # (B, H_kv, C)
    full = stored.sum(dim=-1) >= budget  # (B, H_kv)
    score = acc.sum(dim=0, dtype=torch.promote_types(acc.dtype, torch.float32))  # (B, H_kv, C)
    if form == "mean":
        score = per_query(score, queries_in_window(positions, seen, bucket_steps, acc.shape[0]), form, mean_cap)
    pos = positions.long()
    keep = ~stored | (pos >= (seen - recent)[:, None, None])  # empty slots and the recent window
    if spans is not None:
        keep = keep | in_spans(pos, spans)
    score = score.masked_fill(keep, float("inf"))
    by_position = torch.sort(positions, dim=-1, stable=True).indices  # (B, H_kv, C): oldest first
    by_score = torch.sort(score.gather(2, by_position), dim=-1, stable=True).indices
    order = by_position.gather(2, by_score)  # lowest score first, the older first among equals
    chosen = slot < torch.where(full, drop, 0)[:, :, None]  # (B, H_kv, C): the first n of the order
    dropped = torch.zeros_like(stored).scatter_(2, order, chosen)
    positions.masked_fill_(dropped, -1)


@functools.cache
def compiled_step() -> Callable:
    """:func:`static_step` under ``torch.compile(fullgraph=True)``, built once per process."""
    return torch.compile(static_step, fullgraph=True, dynamic=False)


class StaticDecode(DecodeMode):
    """The static decode step of one :class:`~.budgeted.BudgetedKV`, and the hand-over to and from it.

    Parameters
    ----------
    kv : BudgetedKV
        The layer (checked with :func:`check_static`).

    Class attributes
    ----------------
    compiled : bool
        The step under ``torch.compile(fullgraph=True)`` (``"compiled"``), else eager (``"static"``).
    """

    name = "static"
    compiled: ClassVar[bool] = False

    def __init__(self, kv):
        check_static(kv, self.name)
        self.kv = kv
        self.mode = self.name
        self.active = False
        self.seen: torch.Tensor | None = None  # (B,) on the device while active
        self.spans: torch.Tensor | None = None

    def ready(self) -> bool:
        """Whether the next decode step can be taken here (the layer holds a sequence, and no audit listens)."""
        return self.kv.allocated and not self.kv.listeners

    def begin(self) -> None:
        """Take over the layer: every part's slot axis becomes the budget, the step counter moves to the device."""
        kv = self.kv
        if kv.capacity != kv.budget:
            kv.resize(kv.budget)
        device = kv.slots.positions.device
        self.seen = kv.slots.seen.to(device, copy=True)  # the device copy, advanced in the step
        self.spans = self._spans(device)
        self.active = True

    def _spans(self, device) -> torch.Tensor | None:
        """Every shield's spans as one (R, S, 2) tensor, R = 1 when all rows share them."""
        parts = [shield.spans.to(device) for shield in self.kv.shields]
        if not parts:
            return None
        rows = max(p.shape[0] for p in parts)
        return torch.cat([p.expand(rows, *p.shape[1:]) for p in parts], dim=1).long()

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
             softcap: float | None) -> torch.Tensor:
        """One decode step; the host's lengths advance by what it knows without reading the device."""
        if not self.active:
            self.begin()
        kv = self.kv
        state = kv.state
        assert isinstance(state, ImportanceState) and self.seen is not None
        slots = kv.slots
        # Which rows are at their budget, from the host's lengths (never the device's): the step evicts
        # there, exactly `drop` tokens (the config guarantees enough candidates).
        full = None if slots.uniform is not None else slots.lengths >= kv.budget  # CPU, a ragged batch
        evict = slots.uniform[0] >= kv.budget if full is None else bool(full.any())
        fn = compiled_step() if self.compiled else static_step
        out = fn(kv.store.keys, kv.store.values, slots.positions, state.acc, self.seen, self.spans,
                 query, key, value, budget=kv.budget, recent=kv.recent, drop=kv.drop, form=state.form,
                 bucket_steps=state.bucket_steps, scaling=scaling, softcap=softcap, evict=evict,
                 mean_cap=state.mean_cap)
        if evict:
            kv.compressions += 1
            slots.lengths -= kv.drop if full is None else torch.where(full, kv.drop, 0)
        if full is None:  # rows in step: Python integers, no tensor read back
            length, seen = slots.uniform_state()
            slots.uniform = (length - kv.drop * evict, seen)
            slots.advance_uniform()
        else:
            slots.advance(torch.ones_like(slots.lengths))
        return out

    def settle(self) -> None:
        """Put every slot back in stored order (the layout every other path reads), and hand the layer back."""
        if not self.active:
            return
        kv = self.kv
        positions = kv.slots.positions
        # Stored slots by position, empty ones last: exactly the compact layout the default step keeps.
        key = torch.where(positions >= 0, positions.long(), torch.iinfo(torch.long).max)
        order = torch.sort(key, dim=-1, stable=True).indices  # (B, H_kv, C)
        kv.store.reorder(order)
        for state in kv.states:
            state.compact(order)
        positions.copy_(positions.gather(2, order))
        self.active = False
        self.seen = None


class CompiledDecode(StaticDecode):
    """The static step under ``torch.compile(fullgraph=True)``: ``decode="compiled"``."""

    name = "compiled"
    compiled = True


register_decode(Dynamic)
register_decode(StaticDecode)
register_decode(CompiledDecode)
