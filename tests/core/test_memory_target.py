"""``memory=``: a byte budget that chooses the store and the token budget from the measured frontier."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli, save_tiny_model, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache
from scissorhands.core.planning.memory_target import choose, load_frontier, parse_memory
from scissorhands.hf.cache import memory_shape


@pytest.mark.parametrize("spec,value", [(0.2, 0.2), ("0.2", 0.2), (1.0, 1.0), ("64MiB", 64 * 2**20),
                                        ("1.5GB", 1_500_000_000), ("2kb", 2000), (4096, 4096), ("4096B", 4096)])
def test_memory_specs(spec, value):
    assert parse_memory(spec) == value


@pytest.mark.parametrize("spec", [0.0, -0.5, 1.5, float("nan"), "5XB", "", True, 0, "0b", [0.2], "1", "4096"])
def test_bad_memory_specs_are_one_line(spec):
    with pytest.raises(ValueError, match="^memory: "):
        parse_memory(spec)


def _held(report) -> int:
    """Everything the budgeted layers store: K/V (packed data, scales, residual), importance state, positions."""
    return report["budgeted_kv_bytes"] + report["importance_bytes"] + report["position_bytes"]


@pytest.mark.parametrize("frame", ["fixed", "rotary"])
def test_the_peak_counted_with_key_centres_is_the_peak_stored(tmp_path, frame):
    """Given key centres, memory= counts them too (per layer, and each slot's position for rotary ones): the peak
    it reports is what the cache holds once the prompt fills the budget."""
    from scissorhands.core.planning.memory_target import Family
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("qwen2")
    path = tmp_path / "c.json"
    save_key_centers(measure_key_centers(model, lambda t: {"input_ids": [3 + b % 250 for b in t.encode()]},
                                         "prose " * 40, tokens=120, rotary=frame == "rotary"), path)
    family = Family("kv4r32_rotary", "test", 4, None, None, ((0.1, 0.1), (1.0, 0.01)),
                    key_centers="rotary" if frame == "rotary" else None)
    length, prompt = 420, 380
    choice = choose(0.3, memory_shape(model), length, CacheSettings(kv_key_centers=str(path)), [family])
    assert choice.config.kv_key_centers == str(path) and choice.config.budget < prompt
    cache = ScissorhandsCache(model, choice.config)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, prompt)), cache=cache)
    assert _held(cache.memory_report()) == choice.peak_bytes <= choice.target_bytes


def _in_flight(cache) -> int:
    """Bytes of the block being taken that a residual's exact tail holds beyond its size.

    memory=' peak is between chunks (memory_target's docstring, docs/quantization.md): while a chunk is taken, the
    tail also holds its newest block, as large as the chunk's own K/V activations. Measured inside a chunk, that
    block is set aside; between chunks and while decoding nothing is.
    """
    extra = 0
    for layer in cache.budgeted_layers:
        tail = getattr(layer.kv.store, "tail", None)
        if tail is not None and tail.width > tail.size:
            extra += tail.nbytes() * (tail.width - tail.size) // tail.width
    return extra


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("family", ["kv16", "kv8", "k8v4", "kv4", "kv4r32", "kv4r16", "k4v2r16"])
def test_the_peak_counted_is_the_peak_stored_and_never_above_the_target(arch, family):
    """For every store of the frontier, the chosen peak equals what the cache holds after prefill and after
    decoding (a sliding-window layer keeps its own window and is not counted), and it fits the target."""
    model = tiny_model(arch)
    frontier = [f for f in load_frontier() if f.name == family]
    length, prompt = 420, 380
    for memory in (0.12, 0.2, 0.3, 0.45):  # the first target this store reaches with a budget the prompt fills
        try:
            choice = choose(memory, memory_shape(model), length, CacheSettings(), frontier)
        except ValueError:
            continue
        if choice.config.budget < prompt:
            break
    assert choice.peak_bytes <= choice.target_bytes
    cache = ScissorhandsCache(model, choice.config)
    ids = torch.randint(3, 100, (1, length))
    assert choice.config.budget < prompt  # the prompt fills it
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache)
        assert _held(cache.memory_report()) == choice.peak_bytes
        for t in range(prompt, length):
            model(ids[:, t:t + 1], cache=cache)
            assert _held(cache.memory_report()) <= choice.target_bytes
    assert _held(cache.memory_report()) == choice.peak_bytes


def test_the_choice_follows_the_frontier_and_is_reported(tmp_path):
    model = tiny_model("llama")
    frontier = load_frontier()
    ladder = [choose(m, memory_shape(model), 2048, CacheSettings()) for m in (0.5, 0.33, 0.2, 0.1, 0.05)]
    expected = [c.predicted_delta_nll for c in ladder]
    assert expected == sorted(expected)  # less memory never predicts less loss
    for choice in ladder:  # no other store of the frontier predicts less at this target
        for family in frontier:
            try:
                other = choose(choice.memory, memory_shape(model), 2048, CacheSettings(), [family])
            except ValueError:
                continue
            assert choice.predicted_delta_nll <= other.predicted_delta_nll + 1e-12
    cache = ScissorhandsCache.for_memory(model, 0.2, 600)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 600)), cache=cache)
    record = cache.memory_report()["memory_choice"]
    assert record["peak_bytes"] == _held(cache.memory_report()) <= record["target_bytes"]
    assert "budget" in cache.memory_choice.describe() and "expected ΔNLL" in cache.memory_choice.describe()


def test_a_store_measured_with_rotary_centres_is_chosen_only_with_a_rotary_centre_file(tmp_path):
    """Qwen2's frontier has 4-bit keys measured around rotary centres: memory= takes them when the settings bring
    a rotary file, and never otherwise (nor a tiered store, which cannot read such centres). Only the file's frame
    matters to the choice; the shape is Qwen2.5-Coder-0.5B's."""
    from scissorhands.core.planning.memory_target import Shape
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("qwen2")
    shape = Shape(layers=24, kv_heads=2, head_dim_k=64, head_dim_v=64, itemsize=4, model_type="qwen2")  # the 0.5B
    tokenize = lambda text: {"input_ids": [3 + b % 250 for b in text.encode()]}  # noqa: E731
    paths = {}
    for frame in ("rotary", "fixed"):
        paths[frame] = tmp_path / f"{frame}.json"
        save_key_centers(measure_key_centers(model, tokenize, "prose " * 40, tokens=120, rotary=frame == "rotary"),
                         paths[frame])
    families = load_frontier("qwen2")
    rotary = [f for f in families if f.key_centers == "rotary"]
    assert rotary and all(f.kv_bits == 4 and f.kv_key_bits is None for f in rotary)
    for memory in (0.1, 0.2):
        plain = choose(memory, shape, 2048, CacheSettings())
        fixed = choose(memory, shape, 2048, CacheSettings(kv_key_centers=str(paths["fixed"])))
        turned = choose(memory, shape, 2048, CacheSettings(kv_key_centers=str(paths["rotary"])))
        assert plain.family not in {f.name for f in rotary} and fixed.family not in {f.name for f in rotary}
        assert turned.family in {f.name for f in rotary}, (memory, turned.family)
        assert turned.config.kv_key_centers == str(paths["rotary"]) and turned.peak_bytes <= turned.target_bytes
        assert turned.predicted_delta_nll < plain.predicted_delta_nll
        assert "keys around the given centres" in turned.describe() and not turned.centres_unused
        assert turned.record()["kv_key_centers"] == str(paths["rotary"])
    smol = Shape(layers=30, kv_heads=3, head_dim_k=64, head_dim_v=64, itemsize=4)  # SmolLM2's frontier: no such store
    unused = choose(0.1, smol, 2048, CacheSettings(kv_key_centers=str(paths["rotary"])))
    assert unused.centres_unused and unused.config.kv_key_centers is None
    assert "the key centres given are not used by this store" in unused.describe()
    demoting = [f for f in load_frontier() if f.kv_demote is not None]
    for family in demoting:  # the tiered store would refuse rotary centres when built, so it is never chosen
        with pytest.raises(ValueError, match="^memory: "):
            choose(0.2, shape, 2048, CacheSettings(kv_key_centers=str(paths["rotary"])), [family])


def test_the_frontier_reproduces_its_measured_points():
    for family in load_frontier():
        for fraction, delta in family.points:
            assert family.predicted(fraction) == (pytest.approx(delta), False)


@settings(max_examples=40, deadline=None)
@given(memory=st.floats(0.01, 1.0), length=st.integers(64, 4096))
def test_unreachable_targets_name_the_smallest_reachable(memory, length):
    """A target either gets a choice that fits it, or a one-line error whose smallest reachable size works."""
    import re

    shape = memory_shape(tiny_model("llama"))
    try:
        choice = choose(memory, shape, length, CacheSettings())
    except ValueError as e:
        smallest = int(re.search(r"smallest reachable peak is ([\d,]+) bytes", str(e)).group(1).replace(",", ""))
        assert str(e).startswith("memory: ")
        assert choose(smallest, shape, length, CacheSettings()).peak_bytes <= smallest
        return
    assert choice.peak_bytes <= choice.target_bytes


def test_cli_memory_prints_its_choice_and_refuses_bad_input(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    base = ["generate", "--model", str(folder), "--prompt", "All work and no play makes Jack a dull boy. " * 3,
            "--max-new-tokens", "8"]
    code, _, err = run_cli(capsys, *base, "--memory", "0.2")
    assert code == 0, err
    assert "[scissorhands] memory 0.2: " in err and "expected ΔNLL about" in err
    for extra, message in ((["--memory", "0.2", "--budget", "30"], "memory: give --memory or --budget, not both"),
                           (["--memory", "0.0001"], "memory: '0.0001'"), (["--memory", "9ZB"], "memory: must be"),
                           ([], "budget: required")):
        code, _, err = run_cli(capsys, *base, *extra)
        lines = [x for x in err.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_eval_rows_for_memory_budgets_record_their_choice(tmp_path):
    from conftest import ByteTokenizer
    from scissorhands.core.methods import get_method
    from scissorhands.tools.eval import run_grid
    from scissorhands.tools.eval.runner import MemorySpec
    from scissorhands.tools.eval.tasks import Perplexity
    from scissorhands.tools.generation import demo_prompt

    text = tmp_path / "t.txt"
    text.write_text(demo_prompt())
    model = tiny_model("llama")
    task = Perplexity(seq_len=128, n_windows=2, data=str(text))
    rows = run_grid(model, ByteTokenizer(), model_name="tiny", tasks=[task],
                    methods=[get_method("full"), get_method("scissorhands")], budgets=[MemorySpec(0.2)],
                    base=CacheSettings(), out_dir=tmp_path / "out")
    row = next(r for r in rows if r["method"] == "scissorhands")
    assert row["budget"] == "memory=0.2" and len(row["memory_choice"]) == 2
    choice = row["memory_choice"][0]
    assert choice["peak_bytes"] <= choice["target_bytes"] == int(0.2 * choice["full_bytes"])
    assert row["compression"] == pytest.approx(row["full_kv_bytes"] / row["kv_bytes"]) and row["compression"] >= 5
    assert row["config"]["kv_bits"] == choice["kv_bits"]
    with pytest.raises(ValueError, match="^memory: .* cannot be met"):
        run_grid(model, ByteTokenizer(), model_name="tiny", tasks=[task], methods=[get_method("scissorhands")],
                 budgets=[MemorySpec(16)], base=CacheSettings(), out_dir=tmp_path / "out2")


def test_lm_eval_memory_argument_errors_are_one_line():
    from scissorhands.tools.lm_eval_backend import ScissorhandsLM
    from test_entry_points import _Tokenizer

    model = tiny_model("llama")
    for kwargs, message in (({"memory": 0.2, "budget": 0.2}, "memory: give memory or budget, not both"),
                            ({"memory": "lots"}, "memory: must be"),
                            ({"memory": 0.2, "method": "full"}, "memory: method=full")):
        with pytest.raises(ValueError, match=f"^{message}"):
            ScissorhandsLM(model=(model, _Tokenizer()), **kwargs)


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


@pytest.mark.parametrize("given, named", [
    ({"kv_store": "dense"}, "kv_store"), ({"kv_bits": 2}, "kv_bits"), ({"kv_bits": 4, "kv_demote": "8:0.3"}, "kv_bits"),
    ({"kv_residual": 0}, "kv_residual"), ({"schedule": (50,) * 30}, "schedule"),
])
def test_memory_refuses_a_setting_it_would_override(given, named):
    """A store, width or per-layer budget list given with ``memory`` is refused in one line naming both, at
    every entry point (they all plan through one function); none is overridden in silence."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"^memory: .*{named}") as caught:
        ScissorhandsCache.for_memory(model, 0.2, 200, settings=CacheSettings(**given))
    assert "\n" not in str(caught.value)
    ScissorhandsCache.for_memory(model, 0.2, 200, settings=CacheSettings())  # the same target alone is taken


@pytest.mark.parametrize("length, settings, named", [
    (0, None, "length"), (-5, None, "length"), ("100", None, "length"), (None, None, "length"), (2.5, None, "length"),
    (200, {"recent": 4}, "settings"),
])
def test_for_memory_checks_its_arguments_first(length, settings, named):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"^{named}: "):
        ScissorhandsCache.for_memory(model, 0.2, length, settings=settings)


def test_a_chunked_prompt_aware_prefill_is_counted_at_its_peak(monkeypatch):
    """A chunked prompt-aware prefill holds one chunk beside the budget; memory= counts it, so the bytes held
    at the prefill's peak (just before each layer shrinks back to its budget) fit the target. Unchunked, it
    holds the whole prompt, whatever the budget, and memory= refuses it."""
    from dataclasses import replace

    from scissorhands.core.layer.budgeted import BudgetedKV
    from scissorhands.core.planning.memory_target import peak_bytes

    model = tiny_model("llama")
    length, prompt, chunk = 420, 380, 48
    settings = CacheSettings(prefill="prompt-aware", prompt_chunk=chunk)
    cache = ScissorhandsCache.for_memory(model, 0.3, length, settings=settings)
    choice = cache.memory_choice
    assert choice.config.budget < prompt  # the prompt is evicted, chunk by chunk
    # The chunk is counted: at the same budget, a streamed prefill's peak is smaller.
    assert choice.peak_bytes > peak_bytes(replace(choice.config, prefill="stream", prompt_chunk=None),
                                          memory_shape(model))
    held = []
    resize = BudgetedKV.resize

    def measured(kv, capacity):
        held.append(_held(cache.memory_report()))
        resize(kv, capacity)

    monkeypatch.setattr(BudgetedKV, "resize", measured)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, prompt)), cache=cache)
    held.append(_held(cache.memory_report()))
    assert max(held) > _held(cache.memory_report())  # the peak was inside the prefill, not after it
    assert max(held) <= choice.target_bytes
    with pytest.raises(ValueError, match="^memory: a prompt-aware prefill holds the whole prompt"):
        ScissorhandsCache.for_memory(model, 0.3, length, settings=CacheSettings(prefill="prompt-aware"))


@settings(max_examples=30, deadline=None)
@given(memory=st.floats(0.05, 1.0), arch=st.sampled_from(["llama", "gemma3"]), length=st.integers(96, 360),
       new=st.integers(1, 12), recent=st.sampled_from([0.1, 0.25, 6]), sinks=st.sampled_from([0, 4]),
       schedule=st.sampled_from(["uniform", "increasing"]), window=st.sampled_from([None, 48]),
       rounds=st.booleans(), merge=st.booleans(),
       prefill=st.sampled_from([("stream", None), ("prompt-aware", 16), ("prompt-aware", 40)]))
def test_an_accepted_memory_target_is_never_exceeded(memory, arch, length, new, recent, sinks, schedule, window,
                                                     rounds, merge, prefill):
    """Any target and any settings ``memory=`` accepts: the bytes held, at the prefill's peak (just before a
    prompt-aware layer shrinks back to its budget, less the block in flight in a residual's tail), after it and at
    every decoded token, never exceed the target, and never exceed the peak the choice reported. What it refuses
    is one line naming a parameter. (The demotion chain at 0.348 of 96 tokens, a streamed prefill and recent 0.1,
    is the case that showed the block in flight.)"""
    from scissorhands.core.layer.budgeted import BudgetedKV

    model = tiny_model(arch)
    mode, chunk = prefill
    try:
        base = CacheSettings(recent=recent, sinks=sinks, schedule=schedule, window=window, rounds=rounds,
                             merge=merge and not rounds, prefill=mode, prompt_chunk=chunk)
        cache = ScissorhandsCache.for_memory(model, memory, length, settings=base)
    except ValueError as e:  # refused: one line, naming what is wrong
        assert "\n" not in str(e) and str(e).split(":")[0] in ("memory", "budget", "recent", "sinks", "kv_demote",
                                                                 "kv_residual", "prompt_chunk", "drop"), str(e)
        return
    choice = cache.memory_choice
    held = []
    resize = BudgetedKV.resize

    def measured(kv, capacity):  # inside a chunk: the block being taken is set aside (see _in_flight)
        held.append(_held(cache.memory_report()) - _in_flight(cache))
        resize(kv, capacity)

    ids = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(length))
    prompt = length - new
    BudgetedKV.resize = measured
    try:
        with torch.no_grad():
            model(ids[:, :prompt], cache=cache)
            assert _in_flight(cache) == 0  # between chunks the tail holds its size at most
            held.append(_held(cache.memory_report()))
            for t in range(prompt, length):
                model(ids[:, t:t + 1], cache=cache)
                held.append(_held(cache.memory_report()))
    finally:
        BudgetedKV.resize = resize
    assert max(held) <= choice.peak_bytes <= choice.target_bytes
