"""One place assembles a cache (core/planning/assembly.py): every entry point's layers are the plan's."""

import pytest

from conftest import tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.core.planning.assembly import plan
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.schedule import layer_budgets
from scissorhands.core.stores import PackedKVStore, ResidualStore
from scissorhands.core.tokens.protect import Protection
from scissorhands.hf.cache import cache_plan


def test_the_plan_applies_the_method_splits_the_budget_and_sizes_each_layer():
    settings = ScissorhandsConfig(budget=40, schedule="increasing", kv_bits=4, kv_residual=4, recent=8)
    made = plan(settings, 6, get_method("h2o")())
    assert made.config == get_method("h2o").resolve(settings)  # the method's own settings, applied once
    assert [layer.budget for layer in made.layers] == layer_budgets(made.config, 6)
    assert len(set(layer.budget for layer in made.layers)) > 1
    for i, layer in enumerate(made.layers):
        assert (layer.recent, layer.drop) == (made.config.recent_for(layer.budget), made.config.drop_for(layer.budget))
        assert layer.residual == made.config.check_residual(layer.budget)
        store = made.store(i)
        assert isinstance(store, ResidualStore) and isinstance(store.inner, PackedKVStore)
        assert made.prefill(i).name == made.config.prefill
    # A method class (as the registry holds it) plans as its instance does.
    from_class = plan(settings, 6, get_method("h2o"))
    assert (from_class.config, from_class.layers) == (made.config, made.layers)
    assert from_class.method.name == "h2o"


def test_every_check_is_made_here_with_the_name_the_user_gave():
    with pytest.raises(ValueError, match="^protect-prefix: "):
        plan(ScissorhandsConfig(budget=12, recent=4), 2, protection=Protection.prefix(10),
             protect_name="protect-prefix")
    with pytest.raises(ValueError, match="^config: must be a ScissorhandsConfig"):
        plan(CacheSettings(), 2)
    with pytest.raises(ValueError, match="^memory: needs"):
        plan(CacheSettings(), 2, memory=0.2)


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
