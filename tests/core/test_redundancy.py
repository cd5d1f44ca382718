"""The redundancy-aware method (``rkv``) against a naive loop, and through a budgeted layer."""

import torch
from driver import CoreLayer

from scissorhands.core.methods.base import LayerView
from scissorhands.core.methods.redundancy import RedundancyAware, redundancy
from scissorhands.core.tokens.importance import ImportanceState


class _Slots:
    def __init__(self, positions: torch.Tensor, seen: torch.Tensor):
        self.positions, self.seen = positions, seen
        self.lengths = (positions[:, 0] >= 0).sum(dim=-1)


def _naive_redundancy(keys, positions):
    b, h, n, _ = keys.shape
    out = torch.zeros(b, h, n)
    for r in range(b):
        for k in range(h):
            for i in range(n):
                best = 0.0
                for j in range(n):
                    if positions[r, k, j] > positions[r, k, i] and positions[r, k, j] >= 0:
                        cos = torch.dot(keys[r, k, i], keys[r, k, j]) / (keys[r, k, i].norm() * keys[r, k, j].norm())
                        best = max(best, float(cos))
                out[r, k, i] = best
    return out


def test_redundancy_is_the_largest_cosine_to_a_newer_key():
    """Keys in shuffled slots (positions not in slot order), some near-copies, an empty slot (-1)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 9, 8, generator=gen)
    keys[:, :, 5] = 3 * keys[:, :, 1] + 1e-3 * torch.randn(2, 3, 8, generator=gen)  # a scaled near-copy
    positions = torch.stack([torch.randperm(9, generator=gen) for _ in range(6)]).view(2, 3, 9).int()
    positions[1, :, 8] = -1
    torch.testing.assert_close(redundancy(keys, positions), _naive_redundancy(keys, positions), atol=1e-5, rtol=1e-5)


def test_the_score_weighs_importance_against_redundancy():
    """``share * importance / max + (1 - share) * (1 - redundancy)``, with the Scissorhands importance."""
    gen = torch.Generator().manual_seed(1)
    b, h, n = 1, 2, 7
    state = ImportanceState("sum", None, 1)
    state.allocate(b, h, n, group=1, device="cpu")
    state.acc[0] = torch.rand(b, h, n, generator=gen)
    keys = torch.randn(b, h, n, 4, generator=gen)
    keys[:, :, 2] = keys[:, :, 4]  # token 2 repeats token 4's key exactly: it is all redundant
    positions = torch.arange(n).expand(b, h, n).int()
    view = LayerView(0, n, 0, state, _Slots(positions, torch.tensor([n])), lambda length: (keys, keys))
    got = RedundancyAware().score(view)
    importance = state.acc[0] / state.acc[0].amax(dim=-1, keepdim=True)
    want = 0.1 * importance + 0.9 * (1 - _naive_redundancy(keys, positions))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[..., 2], 0.1 * importance[..., 2])  # a copy of a newer key: importance alone


def test_a_layer_drops_the_older_of_two_copies():
    """Through a budgeted layer: a token whose key a later token repeats is evicted before the others."""
    gen = torch.Generator().manual_seed(2)
    t, d = 14, 8
    q = torch.randn(1, 2, t, d, generator=gen, dtype=torch.float64) * 0.1  # flat attention: importance ties
    k = torch.randn(1, 1, t, d, generator=gen, dtype=torch.float64)
    k[:, :, 9] = k[:, :, 3]  # token 9 repeats token 3's key
    layer = CoreLayer(10, 2, 1, ImportanceState("sum", None, 1), RedundancyAware(), rounds=False)
    for i in range(t):
        layer.attend(q[:, :, i:i + 1], k[:, :, i:i + 1], k[:, :, i:i + 1], None, 0.5)
        if i == 10:  # the first eviction (11 tokens, budget 10) chose among the 9 outside the recent window
            kept = layer.stored_positions(0)[0].tolist()
            assert 3 not in kept and 9 in kept
    assert layer.slots.lengths.tolist() == [10]
