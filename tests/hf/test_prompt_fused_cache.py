"""The prompt-aware prefill's fused head through tiny models: a padded batch takes the tiles, and greedy decoding
keeps the same tokens with and without it (one layer: tests/core/test_prompt_fused.py)."""

import pytest
import torch
from test_prompt_fused import _layer, _run, _tiles_only, spy_on_fused_heads

from conftest import tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig


@pytest.fixture
def fused_calls(monkeypatch):
    """Record what each held prompt's fused head answered (0: none)."""
    return spy_on_fused_heads(monkeypatch)


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
