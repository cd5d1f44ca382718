"""The transformers cache is built from its plan (core/planning/assembly.py; the plan alone:
tests/core/test_assembly.py)."""

from conftest import tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.settings.config import CacheSettings
from scissorhands.hf.cache import cache_plan


def test_a_cache_is_built_from_its_plan_and_for_memory_keeps_what_the_plan_chose():
    model = tiny_model("gemma3")  # sliding layers beside full ones: only the full ones are planned
    config = ScissorhandsConfig(budget=14, recent=3, schedule="increasing", kv_bits=4, kv_residual=2)
    made = cache_plan(model, config)
    cache = ScissorhandsCache(model, config)
    assert len(made.layers) == len(cache.budgeted_layers) < len(cache.layers)
    for part, layer in zip(made.layers, cache.budgeted_layers):
        assert (layer.kv.budget, layer.kv.recent, layer.kv.drop) == (part.budget, part.recent, part.drop)
        assert type(layer.kv.store) is type(made.store(0))
    length = 48
    chosen = cache_plan(model, CacheSettings(), memory=0.3, length=length)
    mem = ScissorhandsCache.for_memory(model, 0.3, length)
    assert chosen.memory_choice is not None and mem.memory_choice == chosen.memory_choice
    assert mem.config == chosen.config and [layer.kv.budget for layer in mem.budgeted_layers] == [
        part.budget for part in chosen.layers]
    # A config in place of a model plans without reading weights.
    assert cache_plan(model.config, config).layers == made.layers
