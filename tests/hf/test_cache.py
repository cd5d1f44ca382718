"""ScissorhandsCache inside real transformers models (tiny, random, offline)."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from conftest import left_padded, tiny_config, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig, ScissorhandsLayer


def greedy(model, ids, mask, cache, n=12, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kw)


def test_identity_with_budget_above_length(arch):
    model = tiny_model(arch)
    ids, mask = left_padded([24, 17], seed=1)
    full = greedy(model, ids, mask, DynamicCache(config=model.config), n=16)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=48, recent=4))
    ours = greedy(model, ids, mask, cache, n=16)
    assert torch.equal(full, ours)
    assert all(layer.compressions == 0 for layer in cache.budgeted_layers)
    # The model still runs a plain DynamicCache the same way after being enabled.
    assert torch.equal(full, greedy(model, ids, mask, DynamicCache(config=model.config), n=16))


def kept_sets(cache):
    return [[layer.stored_positions(b).tolist() for b in range(layer.slots.lengths.numel())]
            for layer in cache.budgeted_layers]


def test_prefill_equals_token_by_token(arch):
    """A prompt longer than the budget, in one forward, equals feeding it one token at a time."""
    model = tiny_model(arch, torch.float64)
    ids, mask = left_padded([40, 33], seed=2)
    cfg = ScissorhandsConfig(budget=14, recent=3, drop=5, window=6, window_buckets=3)
    with torch.no_grad():
        one = ScissorhandsCache(model, cfg)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them for left padding
        logits_one = model(ids, attention_mask=mask, cache=one, position_ids=positions).logits
        step = ScissorhandsCache(model, cfg)
        logits_step = []
        for t in range(ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=step,
                        position_ids=(mask[:, :t + 1].cumsum(-1) - 1).clamp(min=0)[:, -1:])
            logits_step.append(out.logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits_step, 1)[real], logits_one[real], rtol=1e-9, atol=1e-9)
    assert kept_sets(one) == kept_sets(step)
    assert all(layer.compressions > 0 for layer in one.budgeted_layers)


class CacheInspector(LogitsProcessor):
    """Checks the cache after every decoding step of generate()."""

    def __init__(self, cache, recent):
        self.cache, self.recent, self.steps = cache, recent, 0

    def __call__(self, input_ids, scores):
        self.steps += 1
        for layer in self.cache.budgeted_layers:
            assert int(layer.slots.lengths.max()) <= layer.budget
            assert layer.keys.shape[-2] <= layer.budget  # storage itself, not a flag
            assert layer.values.shape[-2] <= layer.budget
            for b in range(layer.slots.lengths.numel()):
                seen = int(layer.slots.seen[b])
                recent = set(range(max(0, seen - self.recent), seen))
                for head in layer.stored_positions(b).tolist():
                    assert recent <= set(head)
                    assert len(head) == len(set(head))
        return scores


@pytest.mark.parametrize("importance", ["sum", "count"])
def test_invariants_during_generate(arch, importance):
    model = tiny_model(arch)
    ids, mask = left_padded([30, 12], seed=3)
    cfg = ScissorhandsConfig(budget=16, recent=5, drop=0.4, window=10, importance=importance,
                             schedule="increasing")
    cache = ScissorhandsCache(model, cfg)
    inspector = CacheInspector(cache, 5)
    out = greedy(model, ids, mask, cache, n=25, logits_processor=LogitsProcessorList([inspector]))
    assert inspector.steps == 25 and out.shape[1] == ids.shape[1] + 25
    report = cache.memory_report()
    assert report["max_stored"] <= max(layer.budget for layer in cache.budgeted_layers)
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)


def assert_rows_equal_alone(model, cfg, lengths, ids, mask, batch_cache, n=15):
    """Greedy generation of a left-padded batch: each row's tokens and kept positions = its sequence alone."""
    batch = greedy(model, ids, mask, batch_cache, n=n)
    for row, length in enumerate(lengths):
        alone_cache = ScissorhandsCache(model, cfg)
        alone = greedy(model, ids[row:row + 1, -length:], mask[row:row + 1, -length:], alone_cache, n=n)
        assert torch.equal(batch[row, -(length + n):], alone[0])
        for lb, la in zip(batch_cache.budgeted_layers, alone_cache.budgeted_layers):
            assert torch.equal(lb.stored_positions(row), la.stored_positions(0))


@pytest.mark.parametrize("arch_name", ["llama", "gemma3", "gpt2", "opt"])
def test_batch_equals_each_sequence_alone(arch_name):
    model = tiny_model(arch_name, torch.float64)
    lengths = [30, 21, 9]
    ids, mask = left_padded(lengths, seed=4)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4, window=8, window_buckets=4)
    batch_cache = ScissorhandsCache(model, cfg)
    assert_rows_equal_alone(model, cfg, lengths, ids, mask, batch_cache)


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_ragged_batch_compacts_only_the_rows_that_evict(kv_bits):
    """Rows of a ragged batch fill at different steps: each eviction reorders only the rows that drop tokens
    (the others are not touched), and every row still equals that sequence alone."""
    model = tiny_model("llama", torch.float64)
    lengths = [30, 21, 9]
    ids, mask = left_padded(lengths, seed=4)
    cfg = ScissorhandsConfig(budget=12, recent=3, drop=4, window=8, window_buckets=4, kv_bits=kv_bits)
    cache = ScissorhandsCache(model, cfg)
    calls = []
    for layer in cache.budgeted_layers:
        reorder = layer.kv.store.reorder

        def spy(order, rows=None, reorder=reorder):
            calls.append(None if rows is None else rows.tolist())
            reorder(order, rows)

        layer.kv.store.reorder = spy
    assert_rows_equal_alone(model, cfg, lengths, ids, mask, cache)
    subsets = [c for c in calls if c is not None]
    assert subsets and all(0 < len(c) < len(lengths) for c in subsets)


def test_sampling_runs_and_matches_full_cache_when_nothing_is_evicted():
    model = tiny_model("llama")
    ids, mask = left_padded([20, 20], seed=5)

    def sample(cache):
        torch.manual_seed(123)
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=15, do_sample=True,
                                  top_k=50, temperature=1.0, pad_token_id=0)

    assert torch.equal(sample(DynamicCache(config=model.config)),
                       sample(ScissorhandsCache(model, ScissorhandsConfig(budget=64))))
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2))
    out = sample(cache)
    assert out.shape == (2, 35) and cache.memory_report()["max_stored"] <= 12


def test_bf16_runs_and_importance_stays_fp32():
    model = tiny_model("llama", torch.bfloat16)
    ids, mask = left_padded([25, 18], seed=6)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2, importance="sum"))
    out = greedy(model, ids, mask, cache, n=10)
    assert out.shape[1] == 35
    layer = cache.budgeted_layers[0]
    assert layer.keys.dtype == torch.bfloat16
    assert layer.state.acc.dtype == torch.float32
    count = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2, importance="count", window=400))
    greedy(model, ids, mask, count, n=4)
    assert count.budgeted_layers[0].state.acc.dtype == torch.int16


def test_gqa_stores_kv_heads_only():
    model = tiny_model("qwen2")  # 6 query heads over 2 KV heads
    ids, mask = left_padded([20], seed=7)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, recent=2))
    greedy(model, ids, mask, cache, n=3)
    assert cache.budgeted_layers[0].keys.shape[1] == 2


def test_gemma3_sliding_layers_keep_their_own_window():
    model = tiny_model("gemma3")
    ids, mask = left_padded([40], seed=8)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=20, recent=2))
    greedy(model, ids, mask, cache, n=10)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "ScissorhandsLayer", "DynamicSlidingWindowLayer",
                     "ScissorhandsLayer"]
    report = cache.memory_report()
    assert report["layers"][0]["stored"] <= 8  # native window, untouched by the budget
    assert report["layers"][1]["stored"] <= 20


def test_memory_report_matches_tensor_storage():
    model = tiny_model("llama")  # head_dim 16, 2 KV heads, fp32
    ids, mask = left_padded([50], seed=9)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=32, recent=4, window=400, window_buckets=8))
    greedy(model, ids, mask, cache, n=10)
    report = cache.memory_report()
    layer = cache.budgeted_layers[0]
    assert report["kv_bytes"] == sum(x.keys.nbytes + x.values.nbytes for x in cache.budgeted_layers)
    m = report["layers"][0]
    assert m["kv_bytes_per_token_head"] == 2 * 16 * 4
    assert m["importance_bytes_per_token_head"] == 8 * 4  # 8 fp32 buckets
    # 50 prompt tokens + 9 fed back (the 10th new token is never fed), 2 heads, K and V, fp32
    assert m["full_kv_bytes"] == 59 * 2 * 2 * 16 * 4
    assert m["capacity"] <= 32 and layer.keys.shape[-2] == m["capacity"]


def test_not_enabled_attention_is_detected():
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    try:
        cache = ScissorhandsCache(model.config, ScissorhandsConfig(budget=8, recent=2))
        ids, mask = left_padded([6], seed=1)
        with torch.no_grad():
            model(ids, attention_mask=mask, cache=cache)
            with pytest.raises(RuntimeError, match="not routed through scissorhands"):
                model(ids[:, :1], attention_mask=torch.ones(1, 7, dtype=torch.long), cache=cache)
    finally:
        ScissorhandsCache(model, ScissorhandsConfig(budget=8, recent=2))  # re-enable for other tests


def test_the_attention_switch_is_scoped_and_can_be_undone():
    """``with scissorhands.enable(model)`` routes the attention inside the block only, and a cache's own switch
    (``cache.attention``) puts the model's implementation back: after either, the model is what it was, bit for
    bit, and the cache evicted while it ran."""
    import scissorhands

    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    ids, mask = left_padded([24, 17], seed=1)
    plain = greedy(model, ids, mask, DynamicCache(config=model.config), n=16)
    cfg = ScissorhandsConfig(budget=12, recent=3)
    with scissorhands.enable(model) as same:
        assert same is model and model.config._attn_implementation == "scissorhands"
        inside = greedy(model, ids, mask, ScissorhandsCache(model.config, cfg), n=16)
    assert model.config._attn_implementation == "sdpa"
    cache = ScissorhandsCache(model, cfg)
    assert model.config._attn_implementation == "scissorhands" and cache.attention.previous == "sdpa"
    assert torch.equal(greedy(model, ids, mask, cache, n=16), inside)
    assert all(layer.compressions > 0 for layer in cache.budgeted_layers)
    cache.attention.restore()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(greedy(model, ids, mask, DynamicCache(config=model.config), n=16), plain)
    # A model that already ran through scissorhands stays so when a later switch is undone.
    scissorhands.enable(model)
    with scissorhands.enable(model):
        pass
    assert model.config._attn_implementation == "scissorhands"
    assert ScissorhandsCache(model.config, cfg).attention is None
    with pytest.raises(ValueError, match="^model: must be a transformers model"):
        scissorhands.enable(model.config)


def test_all_sliding_model_is_rejected():
    from transformers import AutoModelForCausalLM
    cfg = tiny_config("mistral")
    cfg.sliding_window = 16
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="^model: .*no full-attention layer"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=8, recent=2))


def test_layer_budget_check():
    with pytest.raises(ValueError, match="^drop:"):
        ScissorhandsLayer.of_budget(budget=10, recent=5, drop=6)


def test_whole_model_memory_counts_sliding_layers():
    """Gemma 3 (sliding, full, sliding, full): every layer counts, from tensor storage, equal to the analytic size."""
    model = tiny_model("gemma3")  # 1 KV head, head_dim 16, sliding window 8, fp32
    ids, mask = left_padded([40, 40], seed=4)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4))
    greedy(model, ids, mask, cache, n=6)
    full = DynamicCache(config=model.config)
    greedy(model, ids, mask, full, n=6)
    report = cache.memory_report()
    per_token = 2 * 1 * 16 * 4  # K and V, one KV head, head_dim 16, fp32
    seen = 40 + 5  # the 6th new token is never fed back
    window_held = 8 - 1  # transformers' sliding layer keeps its last window - 1 tokens
    sliding = [layer for layer in cache.layers if not isinstance(layer, ScissorhandsLayer)]
    assert report["other_kv_bytes"] == sum(x.keys.nbytes + x.values.nbytes for x in sliding)
    assert report["other_kv_bytes"] == 2 * 2 * window_held * per_token  # 2 sliding layers, batch 2
    budgeted_held = sum(x.keys.nbytes + x.values.nbytes for x in cache.budgeted_layers)
    assert report["model_kv_bytes"] == budgeted_held + report["other_kv_bytes"]
    assert budgeted_held == 2 * 2 * 16 * per_token  # capacity = budget
    # The full side is what DynamicCache really holds for the same run, layer by layer.
    dynamic = sum(x.keys.nbytes + x.values.nbytes for x in full.layers)
    assert report["model_full_kv_bytes"] == dynamic == 2 * 2 * (seen + window_held) * per_token
    assert report["model_compression"] == pytest.approx(dynamic / report["model_kv_bytes"])
    assert report["budgeted_compression"] == pytest.approx(seen / 16)
    assert report["model_compression"] < report["budgeted_compression"]
    for m in report["layers"]:
        if "budget" not in m:
            assert m["storage_bytes"] >= m["kv_bytes"]  # a view into the last update's tensor
    from scissorhands.tools.cli import memory_line

    line = memory_line(report)  # the whole model first, the budgeted layers beside it
    first = float(line.split("x smaller")[0].rsplit(" ", 1)[-1])
    assert "(all 4 layers)" in line and "the 2 budgeted layers alone" in line
    assert first == pytest.approx(report["model_compression"], abs=0.01)


def test_a_used_cache_refuses_another_batch_or_dtype_in_one_line():
    """Continued by a batch of another size, or after the model was cast to another dtype, a used cache is a
    one-line error naming ``cache`` (not a tensor error deep in the selection or the kernel)."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))  # cast below: the shared model must keep its float32 weights
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=3, drop=4))
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=cache)
        with pytest.raises(ValueError, match=r"^cache: .*1 sequence\(s\).*batch of 3") as caught:
            model(torch.randint(3, 256, (3, 1)), cache=cache,
                  position_ids=torch.full((3, 1), 20))
        assert "\n" not in str(caught.value)
        model.to(torch.bfloat16)
        with pytest.raises(ValueError, match=r"^cache: .*torch.float32.*torch.bfloat16"):
            model(ids[:, :1], cache=cache, position_ids=torch.full((1, 1), 20))
        model.to(torch.float32)  # weights rounded through bfloat16: only the dtype matters here
        model(ids[:, :1], cache=cache, position_ids=torch.full((1, 1), 20))  # the cache still serves its own


def test_a_cache_builds_only_from_a_plan_made_for_its_model():
    """``from_plan`` builds what the plan checked and re-checks nothing, so a plan made for another model (other
    layers or K/V heads), or by a layer count alone, is refused in one line; one made for this model builds the
    same layers as the constructor from the same settings."""
    from scissorhands.core.methods.scissorhands import Scissorhands
    from scissorhands.core.planning.assembly import plan
    from scissorhands.hf.cache import cache_plan

    model, other = tiny_model("llama"), tiny_model("qwen2")
    config = ScissorhandsConfig(budget=16, recent=4)
    for made in (cache_plan(other, config), plan(config, model.config.num_hidden_layers, Scissorhands())):
        with pytest.raises(ValueError, match=r"^plan: made for another model \(or by layer count alone\)"):
            ScissorhandsCache.from_plan(model, made)
    built = ScissorhandsCache.from_plan(model, cache_plan(model, config))
    direct = ScissorhandsCache(model, config)

    def parts(cache):
        return [(kv.budget, kv.recent, kv.drop, type(kv.store)) for kv in (x.kv for x in cache.budgeted_layers)]

    assert parts(built) == parts(direct)
    assert len(built.budgeted_layers) == model.config.num_hidden_layers


def test_a_plan_refuses_a_model_with_nothing_to_budget():
    """The plan checks its model's facts once (the cache does not again): a model whose every layer keeps a native
    window has no layer to budget."""
    from transformers import AutoModelForCausalLM

    from scissorhands.hf.cache import cache_plan

    cfg = tiny_config("mistral")
    cfg.sliding_window = 16
    with pytest.raises(ValueError, match="^model: .*no full-attention layer"):
        cache_plan(AutoModelForCausalLM.from_config(cfg), ScissorhandsConfig(budget=8, recent=2))


def test_build_takes_a_configuration_or_a_plan_and_a_plan_keeps_its_own_method_and_spans():
    """``ScissorhandsCache.build``, what ``generate`` and ``answer_cost`` call: a configuration goes to the
    constructor, a plan to ``from_plan``; a method or spans given beside a plan are refused (the plan holds them)."""
    from scissorhands.core.methods.scissorhands import Scissorhands
    from scissorhands.hf.cache import cache_plan

    model = tiny_model("llama")
    config = ScissorhandsConfig(budget=16, recent=4)
    made = cache_plan(model, config)
    for name, given in (("method", {"method": Scissorhands()}), ("protect", {"protect": [(0, 2)]}),
                        ("protect_prefix", {"protect": 2, "protect_name": "protect_prefix"})):
        with pytest.raises(ValueError, match=f"^{name}: a plan holds its method and protected spans"):
            ScissorhandsCache.build(model, made, **given)
    assert ScissorhandsCache.build(model, made).plan is made
    assert ScissorhandsCache.build(model, config).config == ScissorhandsCache(model, config).config
