"""``memory=``: a byte budget that chooses the store and the token budget from the measured frontier."""

from __future__ import annotations

import pytest
import torch

from scissorhands.core.planning.memory_target import load_frontier, parse_memory


@pytest.mark.parametrize("spec,value", [(0.2, 0.2), ("0.2", 0.2), (1.0, 1.0), ("64MiB", 64 * 2**20),
                                        ("1.5GB", 1_500_000_000), ("2kb", 2000), (4096, 4096), ("4096B", 4096)])
def test_memory_specs(spec, value):
    assert parse_memory(spec) == value


@pytest.mark.parametrize("spec", [0.0, -0.5, 1.5, float("nan"), "5XB", "", True, 0, "0b", [0.2], "1", "4096"])
def test_bad_memory_specs_are_one_line(spec):
    with pytest.raises(ValueError, match="^memory: "):
        parse_memory(spec)


def test_the_frontier_reproduces_its_measured_points():
    for family in load_frontier():
        for fraction, delta in family.points:
            assert family.predicted(fraction) == (pytest.approx(delta), False)


@pytest.mark.parametrize("store_settings", [
    dict(),                                             # dense
    dict(kv_bits=8),                                    # packed
    dict(kv_bits=4, kv_key_bits=8, kv_group_size=16),   # packed, wider keys, small groups
    dict(kv_bits=2, kv_demote="8:0.3,4:0.6"),           # tiered: base plane, two pools
    dict(kv_bits=4, kv_demote="16:0.25"),               # tiered: a dense pool
], ids=["dense", "kv8", "k8v4g16", "tiered-8-4-2", "tiered-16-4"])
@pytest.mark.parametrize("tokens", [40, 97])
def test_each_stores_byte_model_is_what_it_allocates(store_settings, tokens):
    """``KVStore.bytes_for`` (the pure byte model ``memory=`` plans with) equals the bytes a store of that kind
    holds once sized to ``tokens`` slots, per KV head and row, for float32 and bfloat16 models."""
    from scissorhands.core.planning.memory_target import Shape
    from scissorhands.core.settings.config import ScissorhandsConfig
    from scissorhands.core.stores import STORES, make_store, store_name

    config = ScissorhandsConfig(budget=tokens, recent=8, drop=2, kv_residual=0, **store_settings)
    for dtype in (torch.float32, torch.bfloat16):
        b, h, d = 2, 3, 32
        store = make_store(config)
        tiers = store.tiered()
        if tiers is not None:  # as a layer does: the widths' pools are sized from the budget first
            tiers.bind(tokens, config.recent_for(tokens), config.drop_for(tokens))
        chunk = torch.zeros(b, h, 1, d, dtype=dtype)
        store.allocate(chunk, chunk)
        store.resize(tokens)
        shape = Shape(layers=1, kv_heads=h, head_dim_k=d, head_dim_v=d, itemsize=chunk.element_size())
        model = STORES[store_name(config)].bytes_for(config, shape, tokens)
        assert model is not None and store.nbytes() == b * h * model, (store.nbytes(), b * h * model)


def test_a_memory_target_needs_a_method_that_evicts_in_the_plan_and_before_anything_loads():
    """One rule, written in the plan's ``check_given``: the plan refuses a memory target for the full cache, and the
    entry points that check early (lm-eval's arguments, the command line) call the same function."""
    from scissorhands.core.methods import get_method
    from scissorhands.core.planning.assembly import check_given, plan
    from scissorhands.core.settings.config import CacheSettings

    full = get_method("full")
    with pytest.raises(ValueError, match=r"^memory: method=full evicts nothing; give an evicting method$"):
        check_given(None, "0.2", full)
    with pytest.raises(ValueError, match=r"^memory: method=full evicts nothing"):
        plan(CacheSettings(), 2, full(), memory="0.2", shape=(2, 2, 16, 4), length=64)
    check_given(None, "0.2", get_method("scissorhands"))  # an evicting method passes
    check_given(64, None, full)  # a budget for the full cache is the plan's to cover, not this rule's
