"""A deliberately naive reference of the eviction semantics (docs/usage.md, "Semantics").

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


BIG = 1e308  # ranks above any score and below the shields (inf): a tiered token evicted only when nothing else is
WIDER = 1e300  # ranks a token wider than the width being demoted above any score and below the shields


def width_table(k, v, widths, group):
    """K/V of every token at every width of a demotion chain: ``{width: (k, v)}``.

    Every token is quantised once at the chain's widest packed width (by the
    library's quantiser, tested on its own in test_packed.py); a token at width
    ``w`` reads its top ``w`` bits with the missing bits at their midpoint. 16
    is the token itself.
    """
    from scissorhands.core.stores.packed import quantize_codes

    top = max(w for w in widths if w < 16)
    table = {}
    for w in widths:
        if w == 16:
            table[w] = (k, v)
            continue
        out = []
        for x in (k, v):
            code, scale, zero = quantize_codes(x, top, group)
            miss = top - w
            q = ((code.to(torch.int32) >> miss) << miss).to(torch.float32)
            q = q.reshape(*q.shape[:-1], scale.shape[-1], -1)
            # (q + (2**miss - 1) / 2) * scale + zero, evaluated in the store's float32 order: the missing
            # bits' midpoint goes into the zero-point first (exact arithmetic gives the same either way).
            if len([b for b in widths if b < 16]) > 1:
                zero = torch.addcmul(zero.float(), torch.full_like(scale, (2**miss - 1) / 2, dtype=torch.float32),
                                     scale.float())
            deq = torch.addcmul(zero.float().unsqueeze(-1), q, scale.float().unsqueeze(-1))
            out.append(deq.reshape(x.shape).to(x.dtype))
        table[w] = tuple(out)
    return table


def pinned(position: int, sinks: int, spans) -> bool:
    """Is ``position`` an attention sink or inside a protected span?"""
    return position < sinks or any(lo <= position < hi for lo, hi in spans)


def reference_stream(q, k, v, valid, *, budget, recent, drop, window, bucket_steps, importance, scaling,
                     sinks=0, value_weighted=False, protect=None, events=None, prefill=0, prefill_drop=None,
                     tiers=None, base_bits=None, group=32, widths_out=None, rounds=False, mean_cap=None):
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
    mean_cap : int or None
        ``"mean"``: the queries are counted up to this many.
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
    rounds : bool
        Eviction in rounds: a full sequence with no victim pending chooses ``drop`` victims by the same rule,
        and each new token evicts the oldest pending one (so it stays at the budget).
    events : list, optional
        If given, every eviction is appended as ``(b, h, step, position, score)``,
        ``step`` being the number of real tokens seen when it was made.
    tiers : list of (bits, cap), optional
        Demotion before eviction (``kv_demote``): the widths above ``base_bits``, widest first, each with the
        most tokens that may hold it or wider. A new token takes the widest width. A compression comes when
        the next token would exceed the budget or a cap; it evicts (at the budget) among the base-width
        tokens, then at each width whose cap is reached, from the last cap to the first, demotes the
        lowest-scoring tokens at exactly that width (wider ones only when none is left) one width down.
        Attention reads each token at its width (:func:`width_table`, quantised in groups of ``group``).

    Returns
    -------
    out : Tensor, shape (B, H_q, T, D); padding queries give zeros
    kept : list[list[list[int]]]; kept[b][h] is the list of positions (index among
        the sequence's real tokens) stored at the end, in stored order
    """
    b_size, h_q, t_len, _ = q.shape
    h_kv = k.shape[1]
    heads_per_kv = h_q // h_kv
    ql, vl, ok = q.tolist(), v.tolist(), valid.tolist()
    widths = [w for w, _ in tiers or ()] + ([base_bits] if tiers else [16])
    table = width_table(k, v, widths, group) if tiers else {16: (k, v)}
    table_l = {w: (a.tolist(), c.tolist()) for w, (a, c) in table.items()}
    out = [[[[0.0] * v.shape[-1] for _ in range(t_len)] for _ in range(h_q)] for _ in range(b_size)]
    kept = []
    for b in range(b_size):
        kept_b = []
        for h in range(h_kv):
            stored = []  # list of [position, column in the input, width], in append order
            history = {}  # key position -> list of (query step, importance added)
            pos = 0  # real tokens seen by this sequence
            pending = []  # rounds: positions of the victims still stored, oldest first
            for t in range(t_len):
                if not ok[b][t]:
                    continue  # padding: never stored, never a query
                wider = [sum(1 for item in stored if item[2] >= w) for w, _ in tiers or ()]
                over = [c + 1 > cap for c, (_, cap) in zip(wider, tiers or ())]
                if len(stored) + 1 > budget or any(over):
                    amount = prefill_drop if prefill_drop is not None and t < prefill else drop

                    spans = protect[b] if protect else ()
                    scores = {}  # taken once, at the start of the event
                    for p, col, _ in stored:
                        seen = [(u, val) for u, val in history.get(p, []) if in_window(u, pos, window, bucket_steps)]
                        score = sum(val for _, val in seen)
                        if importance == "mean":
                            queries = max(1, len({u for u, _ in seen}))
                            score /= queries if mean_cap is None else min(queries, mean_cap)
                        if value_weighted:
                            score *= math.sqrt(sum(x * x for x in vl[b][h][col]))
                        scores[p] = score
                    if rounds and len(stored) + 1 > budget and pending:
                        leaving = pending.pop(0)
                        stored = [item for item in stored if item[0] != leaving]
                    elif len(stored) + 1 > budget:
                        n_drop = max(amount, len(stored) + 1 - budget)
                        scored = []
                        for idx, (p, _, w) in enumerate(stored):
                            if idx >= len(stored) - recent or pinned(p, sinks, spans):
                                score = math.inf
                            elif w != widths[-1]:
                                score = BIG
                            else:
                                score = scores[p]
                            scored.append((score, idx))
                        # Lowest score goes first; among equals the older (smaller index) goes first.
                        scored.sort()
                        gone = {idx for _, idx in scored[:n_drop]}
                        if events is not None:
                            events.extend((b, h, pos, stored[idx][0], scores[stored[idx][0]] if score >= BIG
                                           else score) for score, idx in scored[:n_drop])
                        if rounds:  # the chosen stay until their turn; the oldest leaves now
                            pending = sorted(stored[idx][0] for idx in gone)
                            leaving = pending.pop(0)
                            gone = {i for i, item in enumerate(stored) if item[0] == leaving}
                        stored = [item for idx, item in enumerate(stored) if idx not in gone]
                    for level in reversed(range(len(tiers or ()))):
                        w, cap = tiers[level]
                        count = sum(1 for item in stored if item[2] >= w)
                        if count < cap:
                            continue
                        n = min(amount, count - min(len(stored), recent))
                        # Tokens at exactly this width step down first, then wider ones, then protected ones.
                        ranked = sorted((BIG if pinned(p, sinks, spans) else WIDER if width > w else scores[p], idx)
                                        for idx, (p, _, width) in enumerate(stored)
                                        if width >= w and idx < len(stored) - recent)
                        for _, idx in ranked[:n]:
                            stored[idx][2] = widths[level + 1]
                stored.append([pos, t, widths[0]])
                n = len(stored)
                for j in range(heads_per_kv):
                    head = h * heads_per_kv + j
                    logits = [sum(a * c for a, c in zip(ql[b][head][t], table_l[w][0][b][h][col])) * scaling
                              for _, col, w in stored]
                    top = max(logits)
                    exps = [math.exp(x - top) for x in logits]
                    total = sum(exps)
                    for (p, col, w), e in zip(stored, exps):
                        pr = e / total
                        row = out[b][head][t]
                        for i, val in enumerate(table_l[w][1][b][h][col]):
                            row[i] += pr * val
                        add = (1.0 if pr > 1.0 / n else 0.0) if importance == "count" else pr
                        history.setdefault(p, []).append((pos, add))
                pos += 1
            kept_b.append([p for p, _, _ in stored])
            if widths_out is not None:
                widths_out.setdefault(b, {})[h] = [w for _, _, w in stored]
        kept.append(kept_b)
    return torch.tensor(out, dtype=v.dtype), kept
