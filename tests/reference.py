"""A deliberately naive reference of the eviction semantics (README, "Semantics").

One token at a time, one sequence and one KV head at a time, Python lists of
kept positions, and a dict of per-step contributions. Slow on purpose: it is
meant to be checked by eye, and the fast layer is tested against it.
"""

from __future__ import annotations

import math

import torch


def in_window(step: int, now: int, window: int | None, bucket_steps: int | None) -> bool:
    """Does the query of ``step`` count for a compression made before token ``now``?"""
    if step >= now:
        return False
    if window is None:
        return True
    s = bucket_steps or 1
    n_buckets = math.ceil(window / s)
    # The ring holds the bucket of the last query (now - 1) and the n_buckets - 1 before it.
    return step // s >= (now - 1) // s - n_buckets + 1


def reference_stream(q, k, v, valid, *, budget, recent, drop, window, bucket_steps, importance, scaling,
                     sinks=0, value_weighted=False, protect=None, events=None, prefill=0, prefill_drop=None):
    """Stream a whole sequence batch through a budgeted cache, token by token.

    Parameters
    ----------
    q : Tensor, shape (B, H_q, T, D)
    k, v : Tensor, shape (B, H_kv, T, D)
    valid : BoolTensor, shape (B, T); False marks padding
    budget, recent, drop : int
    window : int or None
    bucket_steps : int or None (None: exact window)
    importance : "sum", "count" or "mean" (the sum over the window divided by the queries in it)
    scaling : float
    sinks : int
        Positions below ``sinks`` are never evicted.
    value_weighted : bool
        Importance times the norm of the token's value.
    protect : list of list of (start, end), optional
        ``protect[b]``: spans of positions of sequence ``b`` that are never evicted.
    prefill, prefill_drop : int
        The first ``prefill`` columns are one chunk (a prompt): an eviction made while taking them
        drops ``prefill_drop`` tokens (the ``prefill_drop`` setting) instead of ``drop``.
    events : list, optional
        If given, every eviction is appended as ``(b, h, step, position, score)``,
        ``step`` being the number of real tokens seen when it was made.

    Returns
    -------
    out : Tensor, shape (B, H_q, T, D); padding queries give zeros
    kept : list[list[list[int]]]; kept[b][h] is the list of positions (index among
        the sequence's real tokens) stored at the end, in stored order
    """
    b_size, h_q, t_len, _ = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    ql, kl, vl, ok = q.tolist(), k.tolist(), v.tolist(), valid.tolist()
    out = [[[[0.0] * v.shape[-1] for _ in range(t_len)] for _ in range(h_q)] for _ in range(b_size)]
    kept = []
    for b in range(b_size):
        kept_b = []
        for h in range(h_kv):
            stored = []  # list of (position, column in the input), in append order
            history = {}  # key position -> list of (query step, importance added)
            pos = 0  # real tokens seen by this sequence
            for t in range(t_len):
                if not ok[b][t]:
                    continue  # padding: never stored, never a query
                if len(stored) + 1 > budget:
                    amount = prefill_drop if prefill_drop is not None and t < prefill else drop
                    n_drop = max(amount, len(stored) + 1 - budget)
                    scored = []
                    for idx, (p, col) in enumerate(stored):
                        pinned = any(lo <= p < hi for lo, hi in (protect[b] if protect else ()))
                        if idx >= len(stored) - recent or p < sinks or pinned:
                            score = math.inf
                        else:
                            seen = [(u, val) for u, val in history.get(p, [])
                                    if in_window(u, pos, window, bucket_steps)]
                            score = sum(val for _, val in seen)
                            if importance == "mean":
                                score /= max(1, len({u for u, _ in seen}))
                            if value_weighted:
                                score *= math.sqrt(sum(x * x for x in vl[b][h][col]))
                        scored.append((score, idx))
                    # Lowest score goes first; among equals the older (smaller index) goes first.
                    scored.sort()
                    gone = {idx for _, idx in scored[:n_drop]}
                    if events is not None:
                        events.extend((b, h, pos, stored[idx][0], score) for score, idx in scored[:n_drop])
                    stored = [item for idx, item in enumerate(stored) if idx not in gone]
                stored.append((pos, t))
                n = len(stored)
                for j in range(group):
                    head = h * group + j
                    logits = [sum(a * c for a, c in zip(ql[b][head][t], kl[b][h][col])) * scaling for _, col in stored]
                    top = max(logits)
                    exps = [math.exp(x - top) for x in logits]
                    total = sum(exps)
                    for (p, col), e in zip(stored, exps):
                        pr = e / total
                        row = out[b][head][t]
                        for i, val in enumerate(vl[b][h][col]):
                            row[i] += pr * val
                        add = (1.0 if pr > 1.0 / n else 0.0) if importance == "count" else pr
                        history.setdefault(p, []).append((pos, add))
                pos += 1
            kept_b.append([p for p, _ in stored])
        kept.append(kept_b)
    return torch.tensor(out, dtype=v.dtype), kept
