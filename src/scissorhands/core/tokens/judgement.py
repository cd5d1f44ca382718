"""A held prompt's judgement, written into the importance ring as its history.

The prompt-aware prefill ranks a held prompt by its last queries and keeps the best; decoding then ranks the kept
tokens by their importance history. :func:`judge` makes that history one that ranks them as the selection did
(:meth:`~.importance.ImportanceState.judged` says how for each form), with the ring arithmetic it needs: how many
of the queries that scored a token fall in each ring slot (:func:`ring_steps`), whole numbers in proportion to
them (:func:`credited`), and rates rounded so that ``rate x queries`` stays exact (:func:`coarse`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Judged(Protocol):
    """What a judgement reads and writes of an importance state (:class:`~.importance.ImportanceState` is one)."""

    form: str
    bucket_steps: int | None
    n_buckets: int
    mean_cap: int | None
    acc: torch.Tensor

    def queries_in_window(self, positions: torch.Tensor, seen: torch.Tensor) -> torch.Tensor: ...


def ring_steps(positions: torch.Tensor, seen: torch.Tensor, bucket_steps: int, n_buckets: int) -> torch.Tensor:
    """How many of the queries that scored each stored token inside the window fall in each ring slot.

    positions (B, H_kv, L), seen (B,) -> float32 (NB, B, H_kv, L), whole numbers adding up over the ring to
    :func:`queries_in_window`: the steps from a token's own to ``now = seen - 1`` that lie in the window, by the
    bucket they belong to.
    """
    s, nb = bucket_steps, n_buckets
    now = (seen - 1).to(positions.device)[:, None, None]  # (B, 1, 1)
    pos = positions.long()
    steps = torch.zeros(nb, *positions.shape, device=positions.device)
    for back in range(nb):  # the window's buckets, newest first
        bucket = now // s - back  # (B, 1, 1)
        lo = torch.maximum(bucket * s, pos)
        hi = torch.minimum(bucket * s + s - 1, now)
        count = ((hi - lo + 1).clamp(min=0) * (bucket >= 0)).to(torch.float32)  # (B, H_kv, L)
        steps.scatter_add_(0, (bucket % nb).expand_as(pos)[None], count[None])
    return steps


def credited(steps: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Whole numbers per ring slot, in proportion to ``steps`` (NB, ...) and adding up to ``total`` (...): the
    steps themselves when they add up to it, else rounded by largest remainder (a cap below the window)."""
    share = steps * (total / steps.sum(dim=0).clamp(min=1))
    whole = share.floor()
    short = total - whole.sum(dim=0)  # (...) what rounding down left out
    place = (share - whole).argsort(dim=0, descending=True, stable=True).argsort(dim=0)  # by remainder
    return whole + (place < short).to(whole.dtype)


def coarse(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` significant bits, so that its product with a whole number below
    ``2 ** (24 - bits)`` is exact in float32."""
    mantissa, exponent = torch.frexp(x)
    scale = float(2 ** max(bits, 1))
    return torch.ldexp(torch.round(mantissa * scale) / scale, exponent)


def judge(state: Judged, observed: torch.Tensor, watched: torch.Tensor, positions: torch.Tensor,
          seen: torch.Tensor) -> None:
    """Replace ``state``'s history of the held prompt's slots by the judgement of its last queries: ``observed``
    (B, H_kv, L) what they paid each slot, ``watched`` (B, H_kv, L) how many of them saw it, ``positions`` the
    slots' positions and ``seen`` (B,) each row's tokens.

    Each slot's history becomes one that ranks it as the selection did:

    - ``sum``: the watched queries' attention, in the ring slot of the prompt's last step, where their steps
      end (it leaves the window when they would);
    - ``mean``: their rate, ``observed / watched``, credited for every query it divides by (those in the
      window, up to ``mean_cap``), as if each query that saw the token had paid it that rate, and spread
      over the ring as those queries' steps fall in its buckets. The rate is rounded to the significant bits
      that keep ``rate x queries`` exact in float32 (12 at the default cap), so that slots the selection
      ranked equal (a max-pooled run) stay exactly equal, and any two paths that hold the same judgement
      (the transformers cache and the vLLM adapter) break those ties alike;
    - ``count`` keeps what the prompt's queries counted: a count over ``1/n`` cannot be made from summed
      probabilities.

    Without it, decoding ranks the kept prompt by the attention of all its queries, which the selection did
    not look at, and the first eviction after the prompt undoes the selection: on Qwen2.5-Coder-0.5B at
    4,096 tokens and 5x, a multikey question's key, held whole in 56% of (layer, KV head) after the prompt,
    was held whole in 10% after the first answered token (docs/results.md, "Retrieval").
    """
    if state.form == "count":
        return
    length = observed.shape[-1]
    nb = state.n_buckets
    if state.form == "sum":  # in place: a window of exact steps has hundreds of ring slots
        rows = (watched > 0).flatten(1).any(dim=1).nonzero().squeeze(1).to(state.acc.device)  # the judged rows
        now = torch.zeros_like(seen) if state.bucket_steps is None else ((seen - 1) // state.bucket_steps) % nb
        state.acc[:, rows, :, :length] = 0
        state.acc[now.to(state.acc.device)[rows], rows, :, :length] = observed[rows].to(state.acc.dtype)
        return
    queries = state.queries_in_window(positions, seen)
    counted = queries if state.mean_cap is None else queries.clamp(max=state.mean_cap)
    rate = coarse(observed / watched.clamp(min=1), 24 - int(counted.max()).bit_length())
    if state.bucket_steps is None:
        history = (rate * counted)[None]
    else:
        history = rate * credited(ring_steps(positions, seen, state.bucket_steps, nb), counted)
    judged = (watched > 0)[None]  # a row none of whose queries was watched (no tokens in a chunk) keeps its own
    state.acc[..., :length] = torch.where(judged, history, state.acc[..., :length]).to(state.acc.dtype)
