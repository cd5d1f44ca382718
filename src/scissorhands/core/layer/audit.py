"""An audit trail of evictions: what each layer dropped, when, and with what importance.

:class:`EvictionAudit` listens to every budgeted layer of a cache (pass it as
``ScissorhandsCache(..., audit=EvictionAudit())``). It is bounded by default:

* **counters**, always: tokens evicted per (layer, sequence, KV head), and for
  each *watched span* (the prompt, a system prompt, any range you name) the
  tokens of the span evicted and the step of its first eviction;
* **events**, only with ``events=True``: every eviction as (layer, step,
  sequence, KV head, position, importance). These grow with the run.

A *step* is the number of tokens the sequence had seen when the eviction was
made, i.e. the position of the token about to be stored. Positions are a
sequence's own token positions (0 = first real token), as in
:mod:`scissorhands.core.tokens.protect`.

:func:`held_map` reads a cache after generation: for each layer, the fraction
of KV heads still holding each position. :meth:`EvictionAudit.summary` answers
"how much of this span is still held, per layer" and "when was it first lost".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class EvictionAudit:
    """Records evictions of a :class:`~scissorhands.hf.cache.ScissorhandsCache`.

    Parameters
    ----------
    events : bool
        Keep every evicted token (layer, step, row, head, position, importance);
        off by default, since it grows with the run. Counters are always kept.
    spans : dict of name -> (start, end), optional
        Position ranges to follow (end exclusive), for every sequence.
    """

    def __init__(self, events: bool = False, spans: dict[str, tuple[int, int]] | None = None):
        self.keep_events = events
        self.spans: dict[str, tuple[int, int]] = {}
        self.layers: list[int] = []
        self.evicted: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv) tokens evicted
        self.span_evicted: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv, n_spans) span tokens evicted
        self.span_first: dict[int, torch.Tensor] = {}  # layer -> (B, H_kv, n_spans) first eviction step, -1 never
        self.seen: dict[int, torch.Tensor] = {}  # layer -> (B,) tokens seen at the last eviction
        self.events: dict[int, list[torch.Tensor]] = {}  # layer -> chunks of (n, 5) [step, row, head, pos, imp]
        for name, span in (spans or {}).items():
            self.watch(name, *span)

    def watch(self, name: str, start: int, end: int) -> None:
        """Follow the span ``[start, end)`` of every sequence (before generation starts)."""
        if self.evicted:
            raise ValueError("audit: spans must be watched before the first eviction")
        if isinstance(start, bool) or isinstance(end, bool) or not (0 <= start < end):
            raise ValueError(f"audit: span {name!r} needs 0 <= start < end, got ({start}, {end})")
        self.spans[name] = (int(start), int(end))

    # -- listener hooks, called by BudgetedKV ---------------------------------------------------------
    def attach(self, layer_idx: int) -> None:
        if layer_idx not in self.layers:
            self.layers.append(layer_idx)

    def _counters(self, layer: int, b: int, h: int) -> None:
        if layer not in self.evicted or self.evicted[layer].shape != (b, h):
            n = len(self.spans)
            self.evicted[layer] = torch.zeros(b, h, dtype=torch.long)
            self.span_evicted[layer] = torch.zeros(b, h, n, dtype=torch.long)
            self.span_first[layer] = torch.full((b, h, n), -1, dtype=torch.long)
            self.seen[layer] = torch.zeros(b, dtype=torch.long)

    def evicted_tokens(self, layer: int, seen: torch.Tensor, positions: torch.Tensor, scores: torch.Tensor,
                       dropped: torch.Tensor) -> None:
        """One eviction of ``layer``: ``dropped`` (B, H_kv, L) marks the slots given up.

        seen : (B,) CPU tokens each row had seen; positions : (B, H_kv, L) their positions;
        scores : (B, H_kv, L) the importance the selection used.
        """
        b, h, _ = dropped.shape
        self._counters(layer, b, h)
        dropped = dropped.cpu()
        self.evicted[layer] += dropped.sum(dim=-1)
        pos = positions.cpu().long()
        self.seen[layer] = seen.clone()
        if self.spans:
            bounds = torch.tensor(list(self.spans.values()))  # (n, 2)
            inside = dropped[..., None] & (pos[..., None] >= bounds[:, 0]) & (pos[..., None] < bounds[:, 1])
            hits = inside.sum(dim=2)  # (B, H_kv, n)
            self.span_evicted[layer] += hits
            first = self.span_first[layer]
            now = seen[:, None, None].expand_as(first)
            self.span_first[layer] = torch.where((first < 0) & (hits > 0), now, first)
        if self.keep_events:
            rows, heads, slots = dropped.nonzero(as_tuple=True)
            self.events.setdefault(layer, []).append(torch.stack([
                seen[rows].double(), rows.double(), heads.double(), pos[rows, heads, slots].double(),
                scores.detach().cpu().double()[rows, heads, slots]], dim=1))

    def select_batch(self, layer: int, index: torch.Tensor) -> None:
        """Rows were reordered or repeated (beam search, batch expansion): counters follow them."""
        if layer in self.evicted:
            idx = index.cpu()
            for table in (self.evicted, self.span_evicted, self.span_first, self.seen):
                table[layer] = table[layer][idx]

    # -- reading --------------------------------------------------------------------------------------
    def event_table(self, layer: int) -> dict[str, list]:
        """Every recorded eviction of ``layer`` (events mode), as columns."""
        if not self.keep_events:
            raise ValueError("audit: events were not recorded; build EvictionAudit(events=True)")
        chunks = self.events.get(layer, [])
        rows = torch.cat(chunks) if chunks else torch.zeros(0, 5, dtype=torch.float64)
        return {"step": rows[:, 0].long().tolist(), "row": rows[:, 1].long().tolist(),
                "head": rows[:, 2].long().tolist(), "position": rows[:, 3].long().tolist(),
                "importance": rows[:, 4].tolist()}

    def summary(self, cache=None, row: int = 0) -> dict:
        """Counters, and per watched span: fraction still held and first eviction step, per layer.

        With ``cache``, the held fraction is read from what the cache holds now
        (exact). Without it, it comes from the counters, as of each layer's
        last eviction: tokens of the span that arrived after it are not counted.
        """
        held_now = _held_positions(cache, row) if cache is not None else None
        out: dict = {"layers": sorted(self.layers), "row": row, "evicted": {}, "spans": {}}
        for layer in sorted(self.layers):
            if layer in self.evicted:
                out["evicted"][layer] = self.evicted[layer][row].tolist()
        for k, (name, (start, end)) in enumerate(self.spans.items()):
            per_layer, first_layer = {}, {}
            for layer in sorted(self.layers):
                if held_now is not None and layer in held_now:
                    held, seen = held_now[layer]
                    n = max(0, min(end, seen) - start)
                    per_layer[layer] = (float(held[start:min(end, seen)].mean()) if n else None)
                elif layer in self.evicted:
                    seen = int(self.seen[layer][row])
                    n = max(0, min(end, seen) - start)
                    lost = self.span_evicted[layer][row, :, k].float().mean()
                    per_layer[layer] = float(1 - lost / n) if n else None
                if layer in self.span_first:
                    first = self.span_first[layer][row, :, k]
                    hit = first[first >= 0]
                    first_layer[layer] = int(hit.min()) if hit.numel() else None
                else:
                    first_layer[layer] = None
            firsts = [v for v in first_layer.values() if v is not None]
            out["spans"][name] = {"start": start, "end": end, "held_fraction": per_layer,
                                  "first_evicted_step": first_layer,
                                  "first_evicted_step_any_layer": min(firsts) if firsts else None}
        return out

    def to_json(self, path: str | Path, cache=None, row: int = 0) -> dict:
        """Write the summary (and the events, if recorded) to ``path``; return what was written."""
        record = self.summary(cache, row)
        if self.keep_events:
            record["events"] = {layer: self.event_table(layer) for layer in sorted(self.layers)}
        if cache is not None:
            record["held_map"] = [[round(x, 3) for x in r] for r in held_map(cache, row).tolist()]
        Path(path).write_text(json.dumps(record))
        return record


def held_by_head(cache, row: int = 0) -> dict[int, torch.Tensor]:
    """layer -> (KV heads, tokens seen) bool: which positions each KV head of each budgeted layer holds now."""
    out = {}
    for layer in cache.budgeted_layers:
        kv = layer.kv
        if not kv.allocated or kv.slots.lengths.numel() == 0:
            continue
        seen = int(kv.slots.seen[row])
        pos = layer.stored_positions(row).long().cpu()  # (H_kv, stored); -1 pads a head that stores fewer
        hits = torch.zeros(pos.shape[0], max(seen, 1))
        hits.scatter_reduce_(1, pos.clamp(min=0), (pos >= 0).float(), reduce="amax")  # an empty slot marks nothing
        out[layer.layer_idx] = hits[:, :seen] > 0
    return out


def _held_positions(cache, row: int) -> dict[int, tuple[torch.Tensor, int]]:
    """layer -> (fraction of KV heads holding each position, tokens seen) for sequence ``row``."""
    return {layer: (by_head.float().mean(dim=0), by_head.shape[1])
            for layer, by_head in held_by_head(cache, row).items()}


def held_map(cache, row: int = 0) -> torch.Tensor:
    """(budgeted layers, tokens seen): fraction of KV heads of each layer holding each position at the end."""
    held = _held_positions(cache, row)
    if not held:
        return torch.zeros(0, 0)
    seen = max(s for _, s in held.values())
    grid = torch.zeros(len(held), seen)
    for i, layer in enumerate(sorted(held)):
        frac, s = held[layer]
        grid[i, :s] = frac
    return grid
