"""The static decode step through the transformers cache: ``generate`` keeps the dynamic step's tokens, a batch
equals each sequence alone, beams and the compiled step run, and the cache refuses what the step cannot serve
(the step itself against the naive reference: tests/core/test_decode_modes.py)."""

import pytest
import torch

from conftest import batch_and_alone, left_padded, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.layer.audit import EvictionAudit
from scissorhands.core.methods import get_method

CASES = [("scissorhands", {}), ("scissorhands", {"window": 8, "window_buckets": 4}),
         ("scissorhands-count", {"window": 6}), ("h2o", {}), ("tova", {}), ("scissorhands", {"sinks": 2}),
         ("scissorhands", {"preset": "paper"})]


@pytest.mark.parametrize("method,extra", CASES)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_generate_with_static_decode_equals_dynamic(arch, method, extra):
    """greedy ``generate`` on a left-padded batch: the same tokens, step scores and stored positions."""
    model = tiny_model(arch, torch.float64)
    ids, mask = left_padded([23, 17], seed=3)
    results = []
    for decode in ("dynamic", "static"):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, decode=decode, **extra), get_method(method)())
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=24, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        stored = [[layer.stored_positions(r) for r in range(2)] for layer in cache.budgeted_layers]
        results.append((out.sequences, torch.stack(out.scores), stored, cache))
    (seq_a, sc_a, st_a, cache_a), (seq_b, sc_b, st_b, cache_b) = results
    assert torch.equal(seq_a, seq_b)
    torch.testing.assert_close(sc_b, sc_a, rtol=1e-9, atol=1e-9)
    for la, lb in zip(st_a, st_b):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)
    assert [layer.kv.compressions for layer in cache_b.budgeted_layers] == \
        [layer.kv.compressions for layer in cache_a.budgeted_layers]
    assert all(int(layer.slots.lengths.max()) <= 12 for layer in cache_b.budgeted_layers)


def test_static_decode_batch_equals_each_sequence_alone():
    batch_and_alone(tiny_model("llama", torch.float64), ScissorhandsConfig(budget=10, decode="static"), [21, 14, 9],
                    seed=5)  # seed 4 meets EOS early in float64, which the helper does not allow


def test_beam_search_with_static_decode_equals_dynamic():
    """Beam reordering settles the layout first, then reorders rows; the result is the dynamic step's."""
    model = tiny_model("llama", torch.float64)
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(6))
    outs = []
    for decode in ("dynamic", "static"):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, decode=decode))
        with torch.no_grad():
            outs.append(model.generate(ids, cache=cache, max_new_tokens=16, num_beams=3, do_sample=False,
                                       pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_compiled_mode_through_generate():
    """``decode="compiled"``: the whole generate path, with the compiled step in every layer."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 18), generator=torch.Generator().manual_seed(8))
    seqs = []
    for decode in ("dynamic", "compiled"):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, decode=decode))
        with torch.no_grad():
            seqs.append(model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False, pad_token_id=0))
    assert torch.equal(seqs[0], seqs[1])


@pytest.mark.parametrize("method", ["local", "streaming", "random"])
def test_static_decode_refuses_methods_without_importance(method):
    with pytest.raises(ValueError, match=r"^decode: 'static' method .* keeps no importance state"):
        ScissorhandsCache(tiny_model("llama"), ScissorhandsConfig(budget=10, decode="static"), get_method(method)())


def test_static_decode_refuses_an_audit():
    with pytest.raises(ValueError, match=r"^decode: 'static' cannot tell an audit"):
        ScissorhandsCache(tiny_model("llama"), ScissorhandsConfig(budget=10, decode="static"), audit=EvictionAudit())


def test_the_full_cache_keeps_the_dynamic_step():
    cache = ScissorhandsCache(tiny_model("llama"), ScissorhandsConfig(budget=10, decode="static"),
                              get_method("full")())
    assert cache.config.decode == "dynamic"
