"""``memory=`` with calibrated key centres, from the command line, in eval rows and in the lm-eval backend (the
choice itself: tests/core/test_memory_target.py, tests/hf/test_memory_target_cache.py)."""

from __future__ import annotations

import pytest
import torch
from test_memory_target_cache import _held

from conftest import run_cli, save_tiny_model, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache
from scissorhands.core.planning.memory_target import choose, load_frontier
from scissorhands.hf.cache import memory_shape


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


def test_cli_memory_prints_its_choice_and_refuses_bad_input(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    base = ["generate", "--model", str(folder), "--prompt", "All work and no play makes Jack a dull boy. " * 3,
            "--max-new-tokens", "8"]
    code, _, err = run_cli(capsys, *base, "--memory", "0.2")
    assert code == 0, err
    assert "[scissorhands] memory 0.2: " in err and "expected ΔNLL about" in err
    for extra, message in ((["--memory", "0.2", "--budget", "30"], "memory: give memory or budget, not both"),
                           (["--memory", "0.0001"], "memory: '0.0001'"), (["--memory", "9ZB"], "memory: must be"),
                           ([], "budget: required"),
                           # the plan's rule, as lm-eval's arguments and the plan refuse it (it was dropped unsaid)
                           (["--memory", "0.2", "--method", "full", "--kv-bits", "4"],
                            "memory: method=full evicts nothing")):
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


def test_rotary_centres_with_a_merge_are_refused_by_the_plan_for_every_entry_point(tmp_path):
    """The rule lives in the plan: the transformers cache, the scorer and a fixed-frame file's contrast."""
    from scissorhands.core.methods import get_method
    from scissorhands.hf.scoring import ScoreSetup
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("llama")
    files = {}
    for rotary in (False, True):
        files[rotary] = tmp_path / f"c{int(rotary)}.json"
        save_key_centers(measure_key_centers(model, lambda t: {"input_ids": [3 + b for b in t.encode()]},
                                             "x y z " * 30, tokens=64, rotary=rotary), files[rotary])
    settings = CacheSettings(recent=4, kv_bits=4, merge=True, kv_key_centers=str(files[True]))
    message = r"^kv_key_centers: rotary centres \(a format-2 file\) cannot be combined with merge=True"
    with pytest.raises(ValueError, match=message):
        ScissorhandsCache(model, settings.with_budget(32))
    with pytest.raises(ValueError, match=message):
        ScoreSetup(get_method("scissorhands"), 32, settings).make_cache(model, 64)
    fixed = ScissorhandsCache(model, CacheSettings(recent=4, kv_bits=4, merge=True,
                                                   kv_key_centers=str(files[False])).with_budget(32))
    assert fixed.config.merge
