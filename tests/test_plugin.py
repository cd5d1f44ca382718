"""A new eviction method is one small class: these are defined here, registered, and pass the shipped tests.

Nothing outside this file changes for them. ``ValueWeighted`` reuses the
windowed importance state and weighs it by the value norm; ``PeakAttention``
brings a per-token state of its own (the largest probability each token ever
received), which the layer keeps aligned with K/V through the state hooks.
"""

import pytest
import torch

from conftest import left_padded, tiny_model
from scissorhands import EvictionMethod, LayerView, ScissorhandsCache, ScissorhandsConfig, TokenState, register
from scissorhands.core.importance import ImportanceState
from scissorhands.core.methods import METHODS, unregister
from test_scoring import assert_scorer_equals_decoding


class ValueWeighted(EvictionMethod):
    """Attention summed over the history window, times the token's value norm."""

    name = "test-value-weighted"
    description = "windowed attention x ||v||"

    def make_state(self, config):
        return ImportanceState.from_settings(config)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.state.scores(view.length) * view.values().float().norm(dim=-1)  # (B, H_kv, L)


class PeakState(TokenState):
    """The largest attention probability each stored token has received, per row and KV head."""

    wants_attention = True

    def __init__(self):
        self.reset()

    def reset(self):
        self.peak = None

    @property
    def allocated(self):
        return self.peak is not None

    def allocate(self, batch, heads, capacity, group, device, dtype):
        self.peak = torch.zeros(batch, heads, capacity, device=device)

    def resize(self, capacity):
        resized = self.peak.new_zeros(*self.peak.shape[:2], capacity)
        keep = min(capacity, self.peak.shape[-1])
        resized[..., :keep] = self.peak[..., :keep]
        self.peak = resized

    def clear(self, start, end):
        self.peak[..., start:end] = 0

    def clear_slots(self, rows, slots):
        self.peak[rows, :, slots] = 0

    def observe(self, probs, attended, steps, valid):
        seen = probs.amax(dim=(2, 3))  # (B, H_kv, L): over the group's heads and the new queries
        length = seen.shape[-1]
        self.peak[..., :length] = torch.maximum(self.peak[..., :length], seen)

    def compact(self, keep):
        self.peak[..., : keep.shape[-1]] = self.peak.gather(2, keep)

    def select_batch(self, index):
        self.peak = self.peak.index_select(0, index)

    def nbytes(self):
        return 0 if self.peak is None else self.peak.nbytes

    def bytes_per_token_head(self):
        return 4


class PeakAttention(EvictionMethod):
    name = "test-peak-attention"
    description = "the largest attention probability a token ever received"

    def make_state(self, config):
        return PeakState()

    def score(self, view: LayerView) -> torch.Tensor:
        return view.state.peak[..., : view.length]


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


def test_registry_rejects_unnamed_and_duplicate_methods():
    class Nameless(EvictionMethod):
        pass

    with pytest.raises(ValueError, match="needs a name"):
        register(Nameless)

    class Clash(EvictionMethod):
        name = "scissorhands"

    with pytest.raises(ValueError, match="already registered"):
        register(Clash)


class OldStore:
    """A K/V store written against the first store interface: no ``residual``, no ``settle``, no ``rows``
    in ``reorder``, and no base class. It must keep working as new features join the interface."""

    read_tile = None

    def __init__(self):
        from scissorhands.core.stores.base import DenseKVStore

        self.inner = DenseKVStore()

    @property
    def capacity(self):
        return self.inner.capacity

    def __getattr__(self, name):
        if name in ("residual", "settle", "read_exact_keys", "read_exact_values"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reorder(self, order):
        self.inner.reorder(order)


def test_a_store_written_before_the_residual_still_works():
    """Ragged batch, evictions, packed-free: the old store gives what the shipped dense store gives."""
    model = tiny_model("llama")
    ids, mask = left_padded([30, 14], seed=5)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4)
    outs = []
    for old in (True, False):
        cache = ScissorhandsCache(model, cfg)
        if old:
            for layer in cache.budgeted_layers:
                layer.kv.store = OldStore()
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=10, do_sample=False,
                                       pad_token_id=0))
        assert cache.memory_report()["peak_stored"] <= 12
    assert torch.equal(*outs)
