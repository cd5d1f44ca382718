"""A step's rounds over vLLM's blocks: the rounding rows of every layer score their windows, choose their victims
and swap them into the slots that leave the window next, as one batch.

Each request's window is ``B`` physical slots (the budget), read through its block table; the layers' positions
and importance accumulators, kept per physical slot, are stacked so that a step's rounds are a few tensor
operations and one compiled call (:func:`.kernels.rounds`) for every layer, or :func:`move_victims_reference` in
torch. The selection is the core's (:func:`~scissorhands.core.tokens.selection.lowest`: recent window and
protected spans shielded, older first among equals); the method scores a :class:`LayerView` of the window.
"""

from __future__ import annotations

from typing import Protocol

import torch

from scissorhands.core.methods.base import EvictionMethod, LayerView
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import Protection, in_spans
from scissorhands.core.tokens.selection import lowest

from . import kernels
from .blocks import copy_slots


class Rounded(Protocol):
    """What a step's rounds read and change of a layer (:class:`~.paged.PagedLayer` is one): its settings, its
    method and importance, its per-slot positions and accumulators, and its cache once a step has run."""

    layer_idx: int
    kv_heads: int
    recent: int
    drop: int
    layout: str
    compiled: bool
    method: EvictionMethod
    importance: ImportanceState | None
    shields: list[Protection]
    pos: torch.Tensor | None
    acc: torch.Tensor | None
    rounds: int
    block: int
    kv_cache: torch.Tensor | None
    defer_rounds: bool

    def read(self, kv_cache, blocks, heads, offs) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _round(self, window: torch.Tensor, seen: torch.Tensor, kv_cache, block: int,
               spans: torch.Tensor | None = None) -> None: ...


class _Slots:
    """The slot table a method's view reads: the window's tokens of the rounding rows, in position order."""

    def __init__(self, positions: torch.Tensor, seen: torch.Tensor):
        self.positions, self.seen = positions, seen
        self.lengths = torch.full((positions.shape[0],), positions.shape[-1], dtype=torch.long)


def round_layers(layers: list[Rounded], pos: torch.Tensor, acc: torch.Tensor | None, kv_caches: list,
                 window: torch.Tensor, seen: torch.Tensor, block: int, spans: torch.Tensor | None = None) -> None:
    """One step's rounds for several layers at once: each rounding row of each layer picks ``drop`` victims per KV
    head and swaps them into its window's leaving slots.

    ``pos`` (L, slots, H_kv) and ``acc`` (L, NB, num_blocks, H_kv, N) hold the layers' positions and importance
    stacked (each layer's own tensors are views of them), ``kv_caches`` their caches, ``window`` (Rr, B) the
    rounding rows' physical slots oldest first (one block table serves every layer), ``seen`` (Rr,) their lengths,
    ``spans`` (Rr, S, 2) the rows' own protected spans (a request's, beside the layers' shields), or None.
    The layers' rows are scored, selected and moved as one batch of ``L * Rr`` rows: what a layer's round gives
    alone, for a method whose scores read no layer index (``EvictionMethod.stackable``); other methods score each
    layer on its own view, and only the selection and the moves are batched. The selection and the moves of every
    layer are one compiled call (:func:`.kernels.rounds`), or :func:`move_victims_reference` for the torch
    references.
    """
    first = layers[0]
    nl, (rr, b_) = len(layers), window.shape
    m, h = first.drop, first.kv_heads
    pos_w = pos[:, window].permute(0, 1, 3, 2).reshape(nl * rr, h, b_).long()  # (L*Rr, H_kv, B) by logical slot
    order = pos_w.argsort(dim=-1)  # position order: the core's stored order
    positions = pos_w.gather(-1, order)
    seen_all = seen.repeat(nl)
    blk, off = window // block, window % block  # (Rr, B)
    state_acc = None
    if acc is not None:
        nbk = acc.shape[1]
        gathered = acc.permute(0, 2, 4, 3, 1)[:, blk, off]  # (L, Rr, B, H_kv, NB)
        gathered = gathered.permute(4, 0, 1, 3, 2).reshape(nbk, nl * rr, h, b_)
        state_acc = gathered.gather(-1, order[None].expand_as(gathered))

    def view(rows: slice, group: list[int]) -> LayerView:
        """The method's view of the rows of the layers ``group`` (indices into ``layers``), stacked in that order."""
        layer = layers[group[0]]
        state = None
        if state_acc is not None:
            assert layer.importance is not None
            state = layer.importance.over(state_acc[:, rows])

        def read(length: int):
            heads = torch.arange(h)[None, :, None]
            slots = window[:, None, :].expand(rr, h, b_)
            ks, vs = [], []
            for i in group:
                mine = slots.gather(-1, order[i * rr:(i + 1) * rr])
                k, v = layers[i].read(kv_caches[i], mine // block, heads, mine % block)
                ks.append(k)
                vs.append(v)
            return torch.cat(ks), torch.cat(vs)

        table = _Slots(positions[rows], seen_all[rows])
        return LayerView(layer.layer_idx, b_, layer.rounds, state, table, read)  # type: ignore[arg-type]

    if nl == 1 or type(first.method).stackable:
        scores = first.method.score(view(slice(None), list(range(nl))))  # (L*Rr, H_kv, B)
    else:
        scores = torch.cat([layer.method.score(view(slice(i * rr, (i + 1) * rr), [i]))
                            for i, layer in enumerate(layers)])
    shield = None
    for part in first.shields:
        mask = part.mask(positions)
        shield = mask if shield is None else shield | mask
    if spans is not None:  # every layer's rows of a request share its spans
        mask = in_spans(positions, spans.repeat(nl, 1, 1))
        shield = mask if shield is None else shield | mask
    if first.compiled and len({layer.layout for layer in layers}) == 1:
        kernels.rounds(kv_caches, first.layout, pos, acc, window, scores, order, shield, first.recent, m)
    else:
        move_victims_reference(layers, pos, acc, kv_caches, window, scores, order, shield, block)
    for layer in layers:
        layer.rounds += 1


def move_victims_reference(layers: list[Rounded], pos: torch.Tensor, acc: torch.Tensor | None, kv_caches: list,
                           window: torch.Tensor, scores: torch.Tensor, order: torch.Tensor,
                           shield: torch.Tensor | None, block: int) -> None:
    """:func:`.kernels.rounds` in torch, layer by layer (the tests' reference, and the path of the torch
    references): each row's ``drop`` lowest-scoring tokens per KV head (the core's ``lowest``) swapped into its
    window's leaving slots, oldest victim first, with their positions and importance.

    ``scores`` (L*Rr, H_kv, B) in position order, ``order`` (L*Rr, H_kv, B) the logical slot of each, ``shield``
    (L*Rr, H_kv, B) bool or None; the others as :func:`round_layers` takes them.
    """
    first = layers[0]
    nl, (rr, b_) = len(layers), window.shape
    m, h = first.drop, first.kv_heads
    n_rows = nl * rr
    full = torch.full((n_rows,), b_, dtype=torch.long)
    victims = lowest(scores, full, first.recent, torch.full((n_rows,), m, dtype=torch.long), shield)
    chosen = torch.sort((~victims).to(torch.uint8), dim=-1, stable=True).indices[..., :m]  # oldest first
    vlog = order.gather(-1, chosen)  # (L*Rr, H_kv, m): the victims' logical slots
    idx = torch.arange(b_)
    isv = torch.zeros(n_rows, h, b_, dtype=torch.bool).scatter_(-1, vlog, True)
    displaced = ~isv & (idx < m)  # kept tokens in the leaving slots
    free = isv & (idx >= m)  # victims' slots outside them
    d_list = torch.sort(torch.where(displaced, idx, b_ + idx), dim=-1).indices[..., :m]
    f_list = torch.sort(torch.where(free, idx, b_ + idx), dim=-1).indices[..., :m]
    valid = torch.arange(m) < displaced.sum(-1, keepdim=True)
    dst = torch.cat([idx[:m].expand(n_rows, h, m), torch.where(valid, f_list, 0)], dim=-1)  # (L*Rr, H_kv, 2m)
    src = torch.cat([vlog, torch.where(valid, d_list, vlog[..., :1])], dim=-1)  # padding repeats pair 0
    wide = window.repeat(nl, 1)[:, None, :].expand(n_rows, h, b_)
    pd = wide.gather(-1, dst).view(nl, rr, h, 2 * m)
    ps = wide.gather(-1, src).view(nl, rr, h, 2 * m)
    heads = torch.arange(h)[None, None, :, None].expand_as(pd)
    lay = torch.arange(nl)[:, None, None, None].expand_as(pd)
    for i, layer in enumerate(layers):
        copy_slots(kv_caches[i], layer.layout, ps[i], pd[i], heads[i], block)
    pos[lay, pd, heads] = pos[lay, ps, heads]
    if acc is not None:
        moved = acc.permute(0, 2, 4, 3, 1)  # (L, num_blocks, N, H_kv, NB), a view
        moved[lay, pd // block, pd % block, heads] = moved[lay, ps // block, ps % block, heads]
