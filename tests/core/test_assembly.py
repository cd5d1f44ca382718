"""One place assembles a cache (core/planning/assembly.py): every entry point's layers are the plan's."""

import pytest

from scissorhands.core.methods import get_method
from scissorhands.core.planning.assembly import plan
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.core.settings.schedule import layer_budgets
from scissorhands.core.stores import PackedKVStore, ResidualStore
from scissorhands.core.tokens.protect import Protection


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


def test_a_layer_built_by_hand_is_checked_as_the_plan_checks_its_layers():
    """The plan hands out layers whose parts it checked, and ``BudgetedKV`` takes them as they are; a layer built by
    hand goes through ``BudgetedKV.checked``, which refuses in one line what the plan would refuse."""
    from scissorhands.core.layer.budgeted import BudgetedKV
    from scissorhands.core.methods.scissorhands import Scissorhands

    with pytest.raises(ValueError, match=r"^drop: must be <= budget - recent \(6\)"):
        BudgetedKV.checked(10, 4, 7, Scissorhands())
    with pytest.raises(ValueError, match="^rounds: cannot be combined with merge"):
        BudgetedKV.checked(10, 4, 2, Scissorhands(), merge=True, rounds=True)
    layer = BudgetedKV.checked(10, 4, 2, Scissorhands(), rounds=True)
    assert (layer.budget, layer.recent, layer.drop, layer.rounds is not None) == (10, 4, 2, True)
