"""keep_order, the one selection every method goes through, on its own."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scissorhands.core.tokens.selection import keep_order


def test_lowest_scores_go_recent_and_shielded_stay_ties_keep_the_newer():
    scores = torch.tensor([[[5.0, 1.0, 1.0, 0.0, 9.0, 0.5]]])  # (B=1, H=1, L=6)
    lengths = torch.tensor([6])
    keep = keep_order(scores, lengths, recent=1, n_drop=torch.tensor([3]))
    # slot 5 is the recent window; the three lowest of the rest are 3 (0.0), then 1 and 2 (tie at 1.0)
    assert keep[0, 0, :3].tolist() == [0, 4, 5] and sorted(keep[0, 0, 3:].tolist()) == [1, 2, 3]
    keep = keep_order(scores, lengths, recent=1, n_drop=torch.tensor([2]))
    assert keep[0, 0, :4].tolist() == [0, 2, 4, 5]  # of the tie, the older slot 1 went
    shield = torch.zeros(1, 1, 6, dtype=torch.bool)
    shield[..., 3] = True
    keep = keep_order(scores, lengths, recent=1, n_drop=torch.tensor([1]), shield=shield)
    assert keep[0, 0, :5].tolist() == [0, 2, 3, 4, 5]


def test_rows_drop_their_own_amount_and_empty_slots_are_never_chosen():
    scores = torch.zeros(2, 1, 5)
    lengths = torch.tensor([5, 3])  # row 1 has two empty slots
    keep = keep_order(scores, lengths, recent=0, n_drop=torch.tensor([2, 1]))
    assert keep[0, 0, :3].tolist() == [2, 3, 4]
    # row 1: slot 0 dropped; the empty slots 3, 4 stay behind the kept ones, the dropped slot comes last
    assert keep[1, 0].tolist() == [1, 2, 3, 4, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 12), st.integers(0, 4), st.integers(0, 2**16))
def test_keep_order_is_a_permutation_that_keeps_exactly_the_rest(b, h, length, recent, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    n_drop = torch.stack([torch.randint(0, max(int(n) - recent, 0) + 1, (1,), generator=gen)[0] for n in lengths])
    scores = torch.randint(0, 4, (b, h, length), generator=gen).float()
    keep = keep_order(scores, lengths, recent, n_drop)
    for row in range(b):
        n, m = int(lengths[row]), int(n_drop[row])
        for head in range(h):
            order = keep[row, head].tolist()
            assert sorted(order) == list(range(length))
            kept, dropped = order[: n - m], order[length - m:]  # empty slots sit between the two
            assert kept == sorted(kept)  # stored order
            assert all(s < n for s in kept + dropped) and all(s < n - recent for s in dropped)
            worst_kept = min((scores[row, head, s].item() for s in kept if s < n - recent), default=float("inf"))
            assert all(scores[row, head, s].item() <= worst_kept for s in dropped)


def _sorted_reference(scores, lengths, recent, n, shield=None):
    """The selection by two stable sorts, as every drop amount takes it: (dropped mask, keep order)."""
    length = scores.shape[-1]
    slot = torch.arange(length)
    score = scores.clone()
    score.masked_fill_((slot[None, :] >= (lengths - recent)[:, None])[:, None, :], float("inf"))
    if shield is not None:
        score.masked_fill_(shield, float("inf"))
    order = torch.sort(score, dim=-1, stable=True).indices
    ranked = slot[None, None, :] < (n[:, None, None] if n.dim() == 1 else n[:, :, None])
    dropped = torch.zeros_like(score, dtype=torch.bool).scatter_(2, order, ranked.expand_as(order).contiguous())
    return dropped, torch.sort(dropped.to(torch.uint8), dim=-1, stable=True).indices


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 12), st.integers(0, 5), st.booleans(), st.booleans(),
       st.integers(0, 2**16))
def test_dropping_one_slot_at_most_equals_the_sorted_selection(b, h, length, recent, per_head, shielded, seed):
    """Decode steps that drop one token (drop=1, the vLLM adapter) take argmin instead of two sorts: the same slots,
    ties (few distinct scores), empty slots, shields and rows that drop nothing included."""
    from scissorhands.core.tokens.selection import lowest

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (b,), generator=gen)
    n = torch.randint(0, 2, (b, h) if per_head else (b,), generator=gen)
    scores = torch.randint(0, 3, (b, h, length), generator=gen).float()
    shield = torch.rand(b, h, length, generator=gen) < 0.3 if shielded else None
    want_dropped, want_order = _sorted_reference(scores, lengths, recent, n, shield)
    assert torch.equal(lowest(scores, lengths, recent, n, shield), want_dropped)
    if not per_head:
        assert torch.equal(keep_order(scores, lengths, recent, n, shield), want_order)
