"""The prompt-aware prefill attends a held prompt's early queries by PyTorch's fused attention.

Only the prompt's last ``observe`` queries judge what a layer keeps, and the state takes their judgement as the
kept tokens' whole history, so the queries before them need no probabilities (``PromptAware._fused_head``). The
reference here is the same layer with every query through the tiles that write probabilities (the fused head
turned off): the outputs agree to float32 rounding (the fused kernel sums in another order, so not bitwise), and
the kept positions, the state after the selection and every decoding step after it are the same. Where the
shortcut would change what is kept (a ``count`` state keeps what every query counted; a padded batch; a packed
store), the tiles take every query.
"""

import pytest
import torch
from driver import CoreLayer

from scissorhands.core.attend.prefill import PromptAware
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState

_FUSED = PromptAware._fused_head


def spy_on_fused_heads(monkeypatch) -> list[int]:
    """The list that records what each held prompt's fused head answers (0: none) from now on."""
    calls: list[int] = []

    def spy(self, *args):
        calls.append(_FUSED(self, *args))
        return calls[-1]

    monkeypatch.setattr(PromptAware, "_fused_head", spy)
    return calls


@pytest.fixture
def fused_calls(monkeypatch):
    """Record what each held prompt's fused head answered (0: none)."""
    return spy_on_fused_heads(monkeypatch)


def _tiles_only(monkeypatch):
    monkeypatch.setattr(PromptAware, "_fused_head", lambda self, *args: 0)


def _layer(form, window, pool, observe=6, budget=24):
    steps, buckets = window if window is not None else (None, 1)
    state = ImportanceState(form, steps, buckets, mean_cap=8 if form == "mean" else None)
    return CoreLayer(budget, 4, 3, state, Scissorhands(), prefill=PromptAware(observe, pool))


def _run(layer, q, k, v, t, steps=5):
    """Prefill ``t`` tokens, then decode ``steps`` more; each call's output and the stored positions after it."""
    outs, kept = [], []
    for a, e in [(0, t)] + [(t + i, t + i + 1) for i in range(steps)]:
        outs.append(layer.attend(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], None, 0.25))
        kept.append([[layer.stored_positions(r)[h].tolist() for h in range(k.shape[1])] for r in range(k.shape[0])])
    return outs, kept


@pytest.mark.parametrize("form,window", [("mean", None), ("sum", None), ("mean", (4, 3)), ("sum", (5, 2))])
@pytest.mark.parametrize("pool", [1, 3])
def test_the_fused_head_keeps_what_the_tiles_keep(form, window, pool, fused_calls, monkeypatch):
    t, steps = 80, 5
    gen = torch.Generator().manual_seed(3 + pool)
    q = torch.randn(2, 4, t + steps, 16, generator=gen) * 2  # 4 query heads over 2 KV heads
    k = torch.randn(2, 2, t + steps, 16, generator=gen)
    v = torch.randn(2, 2, t + steps, 16, generator=gen)
    fused_out, fused_kept = _run(_layer(form, window, pool), q, k, v, t, steps)
    assert fused_calls == [t - 6]  # every query but the last observe took the fused kernel
    _tiles_only(monkeypatch)
    tiles_out, tiles_kept = _run(_layer(form, window, pool), q, k, v, t, steps)
    assert fused_kept == tiles_kept
    for a, b in zip(fused_out, tiles_out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # float32 sums in another order
