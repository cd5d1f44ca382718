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

from conftest import tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.attend.prefill import PromptAware
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.hf.cache import ScissorhandsLayer

_FUSED = PromptAware._fused_head


@pytest.fixture
def fused_calls(monkeypatch):
    """Record what each held prompt's fused head answered (0: none)."""
    calls: list[int] = []

    def spy(self, *args):
        calls.append(_FUSED(self, *args))
        return calls[-1]

    monkeypatch.setattr(PromptAware, "_fused_head", spy)
    return calls


def _tiles_only(monkeypatch):
    monkeypatch.setattr(PromptAware, "_fused_head", lambda self, *args: 0)


def _layer(form, window, pool, observe=6, budget=24):
    steps, buckets = window if window is not None else (None, 1)
    state = ImportanceState(form, steps, buckets, mean_cap=8 if form == "mean" else None)
    return ScissorhandsLayer(budget, 4, 3, state, Scissorhands(), prefill=PromptAware(observe, pool))


def _run(layer, q, k, v, t, steps=5):
    """Prefill ``t`` tokens, then decode ``steps`` more; each call's output and the stored positions after it."""
    outs, kept = [], []
    for a, e in [(0, t)] + [(t + i, t + i + 1) for i in range(steps)]:
        layer.update(k[:, :, a:e], v[:, :, a:e], kwargs={})
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


def test_a_count_state_and_a_padded_batch_take_the_tiles(fused_calls):
    t = 40
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, t, 8, generator=gen) for h in (2, 1, 1))
    _run(_layer("count", None, 1), q, k, v, t, steps=0)  # a count keeps what every query counted
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (2, 60), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # the second row left-padded
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=20, prefill="prompt-aware"))
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    assert fused_calls == [0] + [0] * len(cache.budgeted_layers)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_model_decodes_the_same_tokens_with_and_without_the_fused_head(arch, fused_calls, monkeypatch):
    """Greedy decoding of a tiny model after a prompt-aware prefill: the same tokens, the same kept positions in
    every layer, and log-probabilities within float32 rounding."""
    model = tiny_model(arch)
    ids = torch.randint(3, 200, (1, 150), generator=torch.Generator().manual_seed(7))
    config = ScissorhandsConfig(budget=32, prefill="prompt-aware", observe=16)

    def decode():
        cache = ScissorhandsCache(model, config)
        with torch.no_grad():
            out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
        scores = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores])
        return out.sequences, scores, [layer.stored_positions(0).tolist() for layer in cache.budgeted_layers]

    seq, scores, kept = decode()
    assert fused_calls and all(n == 150 - 16 for n in fused_calls)
    _tiles_only(monkeypatch)
    seq_t, scores_t, kept_t = decode()
    assert torch.equal(seq, seq_t)
    assert kept == kept_t
    torch.testing.assert_close(scores, scores_t, rtol=1e-4, atol=1e-4)
