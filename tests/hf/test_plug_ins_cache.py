"""The plug-ins defined in tests/core/test_plug_ins.py through the transformers cache: a new method, store and
decode mode pass the shipped tests (scorer = token-by-token decoding; batch = each sequence alone), and the
settings they bring reach every layer."""

from dataclasses import replace

import pytest
import torch
from test_plug_ins import Counted, HalfOf, HalfStore, PeakAttention, ValueWeighted
from test_scoring import BASE as SCORING_BASE
from test_scoring import assert_scorer_equals_decoding

from conftest import left_padded, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig, register
from scissorhands.core.layer.decode import DECODES, register_decode, unregister_decode
from scissorhands.core.methods import METHODS, unregister
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import OWNED
from scissorhands.core.stores import register_store, unregister_store


@pytest.fixture(params=[ValueWeighted, PeakAttention])
def plugin(request):
    register(request.param)
    yield request.param
    unregister(request.param.name)


def test_plugin_passes_the_exactness_test_every_method_passes(plugin):
    assert METHODS[plugin.name] is plugin
    assert_scorer_equals_decoding(plugin.name)
    assert_scorer_equals_decoding(plugin.name, arch="gemma3")


def test_plugin_batch_equals_each_sequence_alone(plugin):
    model = tiny_model("llama", torch.float64)
    ids, mask = left_padded([30, 17], seed=4)
    config = ScissorhandsConfig(budget=12, recent=2, drop=3, window=6, window_buckets=None)

    def run(rows):
        cache = ScissorhandsCache(model, config, plugin())
        with torch.no_grad():
            out = model.generate(ids[rows], attention_mask=mask[rows], cache=cache, max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)
        return out[:, -8:], cache

    together, cache = run([0, 1])
    for row in range(2):
        alone, single = run([row])
        assert torch.equal(together[row], alone[0])
        for a, b in zip(cache.budgeted_layers, single.budgeted_layers):
            assert torch.equal(a.stored_positions(row), b.stored_positions(0))
    assert cache.memory_report()["peak_stored"] <= 12


@pytest.fixture
def half_store():
    register_store(HalfStore)
    yield HalfStore
    unregister_store(HalfStore.name)


@pytest.mark.parametrize("residual", [0, 3])
def test_a_new_store_passes_the_exactness_tests(half_store, residual):
    """Registered here, chosen by name, with and without the residual wrapped around it: the scorer equals
    token-by-token decoding, on Llama and on Gemma 3's sliding + global layers."""
    base = replace(SCORING_BASE, kv_store="test-fp16", kv_residual=residual)
    for arch in ("llama", "gemma3"):
        assert_scorer_equals_decoding("scissorhands", arch=arch, base=base)
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, base)
    store = cache.budgeted_layers[0].kv.store
    assert isinstance(store.inner if residual else store, HalfStore)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2)), cache=cache)
    report = cache.memory_report()
    # Two bytes per element, half the float32 cache; the residual's exact tokens on top when asked for.
    assert store.bytes_per_token_head() * 2 == (model.config.head_dim * 2) * 4  # float32 K and V: 4 bytes each
    assert (report["kv_residual_bytes"] > 0) == bool(residual)


def test_a_new_store_keeps_a_batch_equal_to_each_sequence_alone(half_store):
    model = tiny_model("llama")
    ids, mask = left_padded([30, 14], seed=5)
    config = ScissorhandsConfig(budget=12, recent=3, drop=4, kv_store="test-fp16")

    def run(rows):
        cache = ScissorhandsCache(model, config)
        with torch.no_grad():
            out = model.generate(ids[rows], attention_mask=mask[rows], cache=cache, max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)
        return out[:, -8:], cache

    together, cache = run([0, 1])
    assert cache.memory_report()["peak_stored"] <= 12
    for row in range(2):
        alone, single = run([row])
        assert torch.equal(together[row], alone[0])
        for a, b in zip(cache.budgeted_layers, single.budgeted_layers):
            assert torch.equal(a.stored_positions(row), b.stored_positions(0))


def test_a_new_store_brings_a_setting_of_its_own():
    """A store registered here declares ``half_format``: a setting by name while ``kv_store`` names the store
    (each layer's store takes it), a one-line error naming it otherwise, unknown once the store is gone."""
    register_store(HalfOf)
    try:
        model = tiny_model("llama")
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, kv_store="test-half", half_format="bfloat16"))
        with torch.no_grad():
            model(torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(2)), cache=cache)
        assert {layer.kv.store.keys.dtype for layer in cache.budgeted_layers} == {torch.bfloat16}
        with pytest.raises(ValueError, match=r"^half_format: a setting of kv_store='test-half', got kv_store=None, "
                           r"which is 'dense' with these settings$"):
            CacheSettings(half_format="bfloat16")
        with pytest.raises(ValueError, match=r"^half_format: must be one of 'float16' or 'bfloat16', got 'float8'$"):
            CacheSettings(kv_store="test-half", half_format="float8")
    finally:
        unregister_store(HalfOf.name)
    with pytest.raises(TypeError):
        CacheSettings(half_format="bfloat16")


def test_a_new_decode_mode_is_one_class_registered_from_outside():
    """Defined and registered in this file only: ``decode="test-counted"`` gives every layer its step, which takes
    every decode step and keeps what the shipped static step keeps (equal tokens, equal kept positions); an
    unknown name is a one-line error naming ``decode``, as is the mode once unregistered."""
    register_decode(Counted)
    try:
        assert DECODES["test-counted"] is Counted
        model = tiny_model("llama", torch.float32)
        ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(4))
        new = 8

        def run(decode):
            cache = ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=2, drop=2, decode=decode))
            with torch.no_grad():
                out = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)
            return out, cache

        Counted.steps = 0
        mine, cache = run("test-counted")
        shipped, reference = run("static")
        assert all(isinstance(layer.kv.static, Counted) for layer in cache.budgeted_layers)
        assert Counted.steps == (new - 1) * len(cache.budgeted_layers)  # every decode step of every layer
        assert torch.equal(mine, shipped)
        for a, b in zip(cache.budgeted_layers, reference.budgeted_layers):
            for row in range(2):
                assert torch.equal(a.stored_positions(row), b.stored_positions(row))
        with pytest.raises(ValueError, match="^decode: must be a registered decode mode .*'no-such-mode'"):
            ScissorhandsConfig(budget=16, decode="no-such-mode")
    finally:
        unregister_decode(Counted.name)
    with pytest.raises(ValueError, match="^decode: must be a registered decode mode .*'test-counted'"):
        ScissorhandsConfig(budget=16, decode="test-counted")


def test_a_prompt_aware_prefill_at_a_budget_below_its_observed_queries_still_selects():
    """Its last ``observe`` (32) queries' own tokens are kept whatever they score only up to a quarter of the
    budget: at 28 tokens a layer every KV head holds the prompt's newest 7 and 21 older ones chosen by their
    scores (kept whole, the 32 would fill the budget and the selection would hold only the prompt's tail:
    HumanEval at 5x passed no problem so). At 128, a quarter covers the 32, which are all kept."""
    from conftest import tiny_model
    from scissorhands import ScissorhandsCache, ScissorhandsConfig

    model = tiny_model("llama")
    t = 200
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    for budget, newest in ((28, 7), (128, 32)):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, prefill="prompt-aware"))
        model(ids, cache=cache)
        for layer in cache.budgeted_layers:
            heads = layer.stored_positions(0).tolist()
            for held in heads:
                assert sorted(held)[-newest:] == list(range(t - newest, t))
                assert sum(p < t - newest for p in held) == budget - newest
            assert any(p < t - 32 for held in heads for p in held)  # chosen from before the observed queries


def test_the_packed_stores_own_their_settings_and_the_settings_imply_the_store():
    """``kv_key_bits``, ``kv_group_size`` and ``kv_tile`` are the packed store's (and the tiered store's, built on
    it), ``kv_demote`` the tiered store's alone. The store is chosen by name or implied (``kv_demote``: tiered;
    ``kv_bits`` below 16: packed), and a packed store needs a width to pack to; a store's setting with another
    store is one line naming it, and every layer's store is built with the value given. The vLLM adapter, which
    keeps K/V in its own blocks, refuses them all."""
    from scissorhands.core.stores import PackedKVStore
    from scissorhands.vllm.settings import parse

    assert {n: (OWNED[n].axis, OWNED[n].owners) for n in ("kv_key_bits", "kv_group_size", "kv_tile", "kv_demote")} \
        == {"kv_key_bits": ("kv_store", {"packed", "tiered"}), "kv_group_size": ("kv_store", {"packed", "tiered"}),
            "kv_tile": ("kv_store", {"packed", "tiered"}), "kv_demote": ("kv_store", {"tiered"})}
    packed = CacheSettings(kv_bits=4, kv_group_size=16, kv_tile=64)
    assert (packed.store(), packed.kv_group_size, packed.kv_tile, packed.kv_key_bits) == ("packed", 16, 64, None)
    assert CacheSettings(kv_bits=2, kv_demote="4:0.5", kv_group_size=8).store() == "tiered"
    assert CacheSettings(kv_bits=16) == CacheSettings()  # 16 bits is the model's dtype: the dense store
    for given, message in [
        (dict(kv_group_size=16), "kv_group_size: a setting of kv_store='packed' or 'tiered', got kv_store=None, "
                                 "which is 'dense' with these settings"),
        (dict(kv_bits=4, kv_store="dense", kv_tile=64), "kv_tile: a setting of kv_store='packed' or 'tiered', "
                                                        "got kv_store='dense'"),
        (dict(kv_bits=4, kv_store="packed", kv_demote="8:0.5"), "kv_demote: a setting of kv_store='tiered', "
                                                                "got kv_store='packed'"),
        (dict(kv_bits=4, kv_group_size=12), "kv_group_size: must be a power of two >= 4, got 12"),
        (dict(kv_store="packed"), "kv_bits: the packed store packs K/V to 8, 4 or 2 bits, got kv_bits=None"),
    ]:
        with pytest.raises(ValueError) as err:
            CacheSettings(**given)
        assert str(err.value) == message
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=3, kv_bits=4, kv_group_size=8, kv_tile=5))
    stores = [layer.kv.store for layer in cache.budgeted_layers]
    stores = [getattr(s, "inner", s) for s in stores]  # beside its residual
    assert stores and all(isinstance(s, PackedKVStore) and (s.group_size, s.read_tile) == (8, 5) for s in stores)
    for key in ("kv_group_size", "kv_tile", "kv_key_bits"):
        with pytest.raises(ValueError, match=rf"^{key}: not supported by the vLLM adapter \(a setting of "
                                             rf"kv_store='packed' or 'tiered'"):
            parse({"method": "scissorhands", "budget": 16, key: "8"})
