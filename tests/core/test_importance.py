"""The importance state over accumulators an engine keeps itself (``ImportanceState.over``)."""

import pytest
import torch

from scissorhands.core.tokens.importance import ImportanceState


def test_over_scores_the_given_accumulators_without_copying():
    own = ImportanceState("sum", bucket_steps=4, n_buckets=3)
    acc = torch.rand(3, 2, 2, 5)
    state = own.over(acc)
    assert state.allocated and not own.allocated
    assert (state.form, state.bucket_steps, state.n_buckets) == ("sum", 4, 3)
    assert torch.equal(state.scores(5), acc.sum(dim=0))
    acc[0, 0, 0, 0] += 1.0  # shared: the engine's later writes are what the method scores
    assert torch.equal(state.scores(5), acc.sum(dim=0))


def test_over_refuses_accumulators_of_another_ring_in_one_line():
    with pytest.raises(ValueError, match=r"^acc: expected shape \(3, B, H, capacity\), got \(2, 1, 1, 4\)$"):
        ImportanceState("sum", bucket_steps=4, n_buckets=3).over(torch.zeros(2, 1, 1, 4))
