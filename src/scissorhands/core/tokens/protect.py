"""Protected spans: token ranges of a sequence that no layer ever evicts.

A span is ``(start, end)``, end exclusive, in a sequence's own token
positions: 0 is its first real token, padding is not counted (the positions a
budgeted layer's slot table records). Spans may be given once for every
sequence of a batch, or once per sequence:

    protect=[(0, 40)]                       # the first 40 tokens of every sequence
    protect=[[(0, 40)], [(0, 12), (90, 95)]]  # per sequence of a batch of two

Protection is a *shield* of the layer (:class:`~scissorhands.core.layer.budgeted.BudgetedKV`):
at each eviction it marks the stored slots whose positions fall in a span, and
the selection never drops them. Protected tokens count against the budget;
:func:`check_room` rejects a protection that would leave a layer unable to
evict. Attention sinks (the first ``k`` tokens) are the span ``(0, k)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SpanSpec = Sequence[tuple[int, int]] | Sequence[Sequence[tuple[int, int]]]


def _merged_length(spans: list[tuple[int, int]]) -> int:
    """Tokens covered by ``spans``, overlaps counted once."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _check_span(span, name: str, where: str) -> tuple[int, int]:
    if not isinstance(span, (tuple, list)) or len(span) != 2:
        raise ValueError(f"{name}: each span must be a (start, end) pair{where}, got {span!r}")
    start, end = span
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name}: span bounds must be whole token positions{where}, got {span!r}")
    if start < 0 or end <= start:
        raise ValueError(f"{name}: a span needs 0 <= start < end (end exclusive){where}, got {span!r}")
    return int(start), int(end)


def in_spans(positions: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    """Which of ``positions`` (B, H_kv, L) fall in a span of their row: ``spans`` (R, S, 2), R = 1 or B,
    ``[start, end)`` each. Pure tensor operations, so a compiled step can call it too."""
    pos = positions[..., None]  # (B, H_kv, L, 1)
    return ((pos >= spans[:, None, None, :, 0]) & (pos < spans[:, None, None, :, 1])).any(dim=-1)


class Protection:
    """Spans never evicted, one list per sequence (or one list shared by all).

    Parameters
    ----------
    rows : list of list of (start, end)
        ``rows[b]`` are the spans of sequence ``b``; a single row applies to every sequence.
    """

    def __init__(self, rows: list[list[tuple[int, int]]]):
        self.rows = rows
        width = max(1, max(len(r) for r in rows))
        spans = torch.zeros(len(rows), width, 2, dtype=torch.int32)  # padded with empty (0, 0) spans
        for b, row in enumerate(rows):
            if row:
                spans[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        self.spans = spans  # (R, S, 2), R = 1 or the batch size

    @classmethod
    def parse(cls, spec: SpanSpec | Protection | None, name: str = "protect") -> Protection | None:
        """A ``Protection`` from the user's spans; one-line ``ValueError`` naming ``name`` if malformed."""
        if spec is None or isinstance(spec, Protection):
            return spec
        if not isinstance(spec, (list, tuple)):
            raise ValueError(f"{name}: must be a list of (start, end) spans, or one such list per sequence, "
                             f"got {type(spec).__name__}")
        if not spec:
            return None
        flat = all(isinstance(s, (list, tuple)) and not any(isinstance(v, (list, tuple)) for v in s) and s
                   for s in spec)
        if flat:  # one list of spans, for every sequence
            return cls([[_check_span(s, name, "") for s in spec]])
        rows = []
        for b, row in enumerate(spec):
            if not isinstance(row, (list, tuple)):
                raise ValueError(f"{name}: sequence {b}: must be a list of (start, end) spans, got {row!r}")
            rows.append([_check_span(s, name, f" (sequence {b})") for s in row])
        return cls(rows)

    @classmethod
    def prefix(cls, tokens: int) -> Protection:
        """The first ``tokens`` positions of every sequence (attention sinks, a system prompt)."""
        return cls([[(0, tokens)]])

    def __repr__(self) -> str:
        return f"Protection({self.rows!r})"

    def counts(self) -> list[int]:
        """Protected tokens per sequence (overlaps counted once; a span past the end still counts whole)."""
        return [_merged_length(r) for r in self.rows]

    def counts_in(self, starts: list[int], ends: list[float]) -> list[int]:
        """Protected positions of each row ``b`` in ``[starts[b], ends[b])`` (overlaps counted once); ``starts``
        and ``ends`` hold one bound per row of the batch, which shared spans serve alike."""
        rows = self.rows if len(self.rows) == len(starts) else [self.rows[0]] * len(starts)
        out = []
        for row, lo, hi in zip(rows, starts, ends):
            clipped = [(max(s, lo), min(e, hi)) for s, e in row if min(e, hi) > max(s, lo)]
            out.append(_merged_length(clipped))  # type: ignore[arg-type]
        return out

    def for_batch(self, batch: int) -> Protection:
        """The protection of a batch of ``batch`` rows.

        Shared spans apply to every row. Per-sequence spans apply to a batch of
        that many sequences, or to one expanded ``k`` times (``num_beams``,
        ``num_return_sequences``): transformers repeats each sequence ``k``
        times in place, so row ``i`` gets the spans of sequence ``i // k``.
        Anything else is a one-line ``ValueError``.
        """
        n = len(self.rows)
        if n in (1, batch):
            return self
        if batch % n:
            raise ValueError(f"protect: {n} per-sequence span lists for a batch of {batch} sequences "
                             f"(a batch must hold each sequence the same number of times)")
        k = batch // n
        return Protection([row for row in self.rows for _ in range(k)])

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Which slots hold a protected position: bool, shaped like ``positions`` (B, H_kv, L)."""
        return in_spans(positions, self.spans.to(positions.device))

    def select_batch(self, index: torch.Tensor) -> Protection:
        """The protection of the rows ``index`` (beam reordering, batch expansion); shared spans stay shared."""
        if len(self.rows) == 1:
            return self
        return Protection([self.rows[int(i)] for i in index.tolist()])


def check_room(protection: Protection | None, budgets: list[tuple[int, int, int]], name: str = "protect") -> None:
    """Reject a protection that leaves some layer unable to evict.

    ``budgets`` holds ``(budget, recent, drop)`` of every budgeted layer. A
    full layer must be able to drop ``drop`` tokens outside the recent window
    and the protected spans, so protected + recent + drop <= budget, in the
    layer with the least room. Protection is never silently dropped.
    """
    if protection is None or not budgets:
        return
    counts = protection.counts()
    worst = max(range(len(counts)), key=counts.__getitem__)
    need = counts[worst]
    budget, recent, drop = min(budgets, key=lambda x: x[0] - x[1] - x[2])
    room = budget - recent - drop
    if need > room:
        where = f" (sequence {worst})" if len(counts) > 1 else ""
        raise ValueError(f"{name}: {need} protected tokens{where} do not fit: a layer budget of {budget} keeps "
                         f"{recent} recent tokens and must be able to evict {drop} at once, which leaves room "
                         f"for at most {room} protected tokens")
