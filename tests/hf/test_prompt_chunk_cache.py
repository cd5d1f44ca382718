"""The chunked prompt-aware prefill through the transformers cache: a batch equals each sequence alone, the
scorer equals decoding after the prompt, padding (the prefill against its naive reference:
tests/core/test_prompt_chunk.py)."""

import pytest
import torch

from conftest import batch_and_alone, left_padded, scored_and_decoded, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.hf.scoring import ScoreSetup


def test_a_chunk_as_long_as_the_prompt_is_the_held_prefill():
    """``prompt_chunk`` >= the prompt: bitwise the unchunked prompt-aware prefill."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    results = []
    for chunk in (None, 40, 64):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, prefill="prompt-aware", prompt_chunk=chunk))
        with torch.no_grad():
            results.append((model(ids, cache=cache).logits, [layer.stored_positions(0) for layer in
                                                               cache.budgeted_layers]))
    for logits, kept in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(kept, results[0][1]))


def test_chunked_prompt_aware_batch_equals_each_sequence_alone():
    batch_and_alone(tiny_model("qwen2", torch.float64),
                    ScissorhandsConfig(budget=10, prefill="prompt-aware", prompt_chunk=6, observe=4), [31, 22, 9],
                    seed=6)  # seed 5 meets EOS early, which the helper does not allow


def test_chunked_prompt_aware_scorer_equals_decoding_after_the_prompt():
    """The exact scorer's continuation equals decoding it token by token after a chunked prompt."""
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    context = torch.randint(3, 256, (45,), generator=gen).tolist()
    cont = torch.randint(3, 256, (10,), generator=gen).tolist()
    settings = CacheSettings(recent=3, drop=4, prefill="prompt-aware", observe=5, prompt_chunk=12)
    setup = ScoreSetup(get_method("scissorhands"), 16, settings)
    total, decoded, cache = scored_and_decoded(model, context, cont, setup)
    assert total == pytest.approx(decoded, abs=1e-4)
    report = cache.memory_report()
    assert report["max_stored"] <= 16 and report["peak_stored"] <= 16 + 12


def test_generate_with_padding_and_a_chunked_prompt():
    model = tiny_model("gemma3", torch.float64)
    ids, mask = left_padded([30, 17], seed=2)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, prefill="prompt-aware", prompt_chunk=7))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for layer in cache.budgeted_layers:
        assert layer.slots.peak <= 17 and int(layer.slots.lengths.max()) <= 10
