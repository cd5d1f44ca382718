"""Packed low-bit K/V from the tools: the command line's flags, generate and eval, calibrated key centres, eval's
records (the quantiser and the stores: tests/core/test_packed.py)."""

from dataclasses import replace

import pytest
import torch
from test_scoring import BASE, decode_logprobs

from conftest import batch_and_alone, run_cli, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.core.stores import ResidualStore
from scissorhands.core.stores.packed import PackedKVStore
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup, token_logprobs


def test_batched_generation_equals_each_sequence_alone_with_rotary_key_centres(tmp_path):
    """Each row's keys are centred at its own positions (counted in real tokens, as the model's position ids are
    under left padding), so a padded batch keeps and generates what each sequence alone does."""
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("llama", torch.float64)
    path = tmp_path / "rotary.json"
    record = measure_key_centers(model, lambda t: {"input_ids": [3 + b % 250 for b in t.encode()]}, "prose " * 30,
                                 tokens=120, rotary=True)  # Llama has no key bias: rotary only when asked
    assert record["format"] == "scissorhands-key-centers/2"
    save_key_centers(record, path)
    cfg = ScissorhandsConfig(budget=12, recent=4, drop=4, kv_bits=4, kv_group_size=8, kv_key_centers=str(path))
    batch_cache, _ = batch_and_alone(model, cfg, [30, 21, 9])
    for layer in batch_cache.budgeted_layers:  # each kept key was centred at its token's own position
        kv = layer.kv
        store = kv.store.inner if isinstance(kv.store, ResidualStore) else kv.store
        assert kv.store.wants_positions and kv.slots.seen.min() > cfg.budget  # every row has evicted
        for row, length in enumerate(kv.slots.lengths.tolist()):
            torch.testing.assert_close(store.k.pos[row, :, :length, 0], kv.slots.positions[row, :, :length],
                                       rtol=0, atol=0)


# -- the command line -----------------------------------------------------------------------------

_cli = run_cli


@pytest.mark.parametrize("flag,value,param", [("--kv-bits", "3", "kv-bits"), ("--kv-group-size", "6", "kv-group-size"),
                                              ("--kv-key-bits", "8", "kv-key-bits"),
                                              ("--kv-residual", "-1", "kv-residual"),
                                              ("--kv-residual", "4", "kv-residual")])
def test_cli_rejects_bad_kv_flags_in_one_line(capsys, flag, value, param):
    code, _, err = _cli(capsys, "generate", "--budget", "50", flag, value, "--prompt", "hi")
    assert code == 2 and err.strip().count("\n") == 0 and param in err


def test_cli_generate_and_eval_with_packed_kv(capsys, tmp_path):
    import json

    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    code, out, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "4", "--kv-bits", "4",
                          "--kv-key-bits", "8", "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "packed: data" in err and "against a bf16 full cache" in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--method", "full", "--kv-bits", "2",
                        "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "budget none" in err and "packed: data" in err and "no saving" not in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "8", "--kv-bits", "4",
                        "--kv-residual", "8", "--prompt", prompt, "--max-new-tokens", "5", "--ignore-eos")
    assert code == 0, err
    assert "full-precision residual" in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "400", "--kv-bits", "4", "--prompt", "hi",
                        "--max-new-tokens", "3", "--ignore-eos")
    assert code == 0, err
    assert "no saving, on" in err and "residual" in err  # 32 exact tokens outweigh what packing saves on 5
    data = tmp_path / "text.txt"
    data.write_text("All the world's a stage, and all the men and women merely players. " * 30)
    code, _, err = _cli(capsys, "eval", "--model", tiny, "--methods", "full,scissorhands", "--budgets", "0.5",
                        "--tasks", "ppl", "--text", str(data), "--seq-len", "64", "--num-samples", "2",
                        "--kv-bits", "4", "--kv-group-size", "8", "--kv-residual", "0", "--out", str(tmp_path / "out"))
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"full", "scissorhands"}
    assert all(r["key"]["settings"]["kv_bits"] == 4 and r["key"]["settings"]["kv_group_size"] == 8 for r in records)
    # the recorded K/V bytes are the packed ones: 4-bit K and V of 16 channels in groups of 8, 8 + 2 * 4 bytes each,
    # against 2 * 16 * 4 bytes in float32, for every token the cell keeps
    for r in records:
        assert r["kv_bytes"] == pytest.approx(r["mean_budget"] / r["mean_length"] * r["full_kv_bytes"] * 32 / 128)


def test_cache_with_key_centres_scores_exactly_and_rejects_bad_files(tmp_path):
    import json

    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("gemma3")  # sliding layers: only the full-attention layers get centres
    record = measure_key_centers(model, lambda text: {"input_ids": [3 + b % 250 for b in text.encode()]},
                                 "the calibration text " * 20, tokens=200)
    path = tmp_path / "centres.json"
    save_key_centers(record, path)
    assert record["tokens"] == 200 and len(record["layers"]) == len(model_facts(model).full_layers)
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=4, kv_group_size=8, kv_key_centers=str(path))
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    store = cache.budgeted_layers[0].kv.store
    store = store.inner if isinstance(store, ResidualStore) else store  # the default residual wraps it
    assert store.k.center is not None and cache.memory_report()["peak_stored"] <= 16
    plain_setup = ScoreSetup(get_method("scissorhands"), 16, replace(base, kv_key_centers=None))
    plain, _ = token_logprobs(model, ids, plain_setup)
    assert not torch.equal(fast, plain)  # the centres are really used

    bad = tmp_path / "bad.json"
    for content, message in [("{", "is not a key-centre file"), ('{"format": "x"}', "is not a key-centre file"),
                             (json.dumps({**record, "signature": {"layer_types": []}}), "another model"),
                             (json.dumps({**record, "layers": {}}), "no valid centres")]:
        bad.write_text(content)
        with pytest.raises(ValueError, match="^kv_key_centers: .*" + message):
            ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, kv_key_centers=str(bad)))
    with pytest.raises(ValueError, match="^kv_key_centers: no such file"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4,
                                                    kv_key_centers=str(tmp_path / "none.json")))
    with pytest.raises(ValueError, match="^kv_key_centers: needs packed K/V"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_key_centers=str(path)))


def test_cli_calibrate_then_generate_with_centres(capsys, tmp_path):
    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    text = tmp_path / "calib.txt"
    text.write_text("A calibration text of plain prose, not the data under test. " * 20)
    out = tmp_path / "c.json"
    import json

    for frame, fmt in (("auto", 1), ("rotary", 2), ("fixed", 1)):  # the tiny Llama has no key bias: auto is fixed
        code, _, err = _cli(capsys, "calibrate", "--model", tiny, "--text", str(text), "--tokens", "128",
                            "--frame", frame, "--out", str(out))
        assert code == 0, err
        assert out.is_file() and "key centres of" in err
        assert json.loads(out.read_text())["format"] == f"scissorhands-key-centers/{fmt}"
        code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--recent", "4", "--kv-bits", "4",
                            "--kv-key-centers", str(out), "--prompt", "the quick brown fox " * 8,
                            "--max-new-tokens", "5", "--ignore-eos")
        assert code == 0, err
    for args, param in [(["--text", str(tmp_path / "missing.txt")], "text"), (["--tokens", "1"], "tokens"),
                        (["--frame", "sideways"], "frame")]:
        code, _, err = _cli(capsys, "calibrate", "--model", tiny, "--text", str(text), "--out", str(out), *args)
        assert code == 2 and err.strip().count("\n") == 0 and param in err
    code, _, err = _cli(capsys, "generate", "--model", tiny, "--budget", "32", "--kv-key-centers", str(out),
                        "--prompt", "hi")
    assert code == 2 and "kv-key-centers" in err


def test_calibrated_rotary_centres_are_the_key_bias_before_rope_and_score_exactly(tmp_path):
    """On a Qwen2 whose key projection is only a bias, the centres measured before RoPE are that bias; with a real
    projection and a large bias, 4-bit keys around them score as token-by-token decoding does, and closer to the
    dense cache than fixed centres or none."""
    import copy
    import json

    from scissorhands.core.planning.memory_target import Shape
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    tokenize = lambda text: {"input_ids": [3 + b % 250 for b in text.encode()]}  # noqa: E731
    model = copy.deepcopy(tiny_model("qwen2"))  # the shared model is not touched
    gen = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        bias = layer.self_attn.k_proj.bias
        bias.data = torch.randn(bias.shape, generator=gen) * 8  # Qwen2's keys carry such offsets
    only_bias = copy.deepcopy(model)
    for layer in only_bias.model.layers:
        layer.self_attn.k_proj.weight.data.zero_()
    record = measure_key_centers(only_bias, tokenize, "calibration prose " * 20, tokens=150)
    assert record["format"] == "scissorhands-key-centers/2" and record["rotary"]["scaling"] == 1.0
    head_dim = only_bias.model.layers[0].self_attn.head_dim
    for i, layer in enumerate(only_bias.model.layers):
        want = layer.self_attn.k_proj.bias.detach().view(-1, head_dim)
        torch.testing.assert_close(torch.tensor(record["layers"][str(i)]), want, rtol=0, atol=1e-4)
    assert measure_key_centers(only_bias, tokenize, "calibration prose " * 20, tokens=150,
                               rotary=False)["format"] == "scissorhands-key-centers/1"

    paths = {}
    for frame in ("rotary", "fixed"):
        paths[frame] = tmp_path / f"{frame}.json"
        save_key_centers(measure_key_centers(model, tokenize, "calibration prose " * 20, tokens=150,
                                             rotary=frame == "rotary"), paths[frame])
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1))
    base = replace(BASE, kv_bits=8, kv_key_bits=4, kv_group_size=32, kv_residual=0,  # keys carry the loss
                   kv_key_centers=str(paths["rotary"]))
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    slow, cache = decode_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, base))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    assert cache.budgeted_layers[0].kv.store.wants_positions
    shape = Shape(layers=2, kv_heads=2, head_dim_k=head_dim, head_dim_v=head_dim, itemsize=4)
    store = cache.budgeted_layers[0].kv.store
    assert PackedKVStore.bytes_for(base, shape, 10) == 10 * store.bytes_per_token_head()
    dense, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, CacheSettings()))
    gap = {}
    for frame in ("rotary", "fixed", None):
        settings = replace(base, kv_key_centers=None if frame is None else str(paths[frame]))
        lp, _ = token_logprobs(model, ids, ScoreSetup(get_method("full"), None, settings))
        gap[frame] = float((lp - dense).abs().mean())
    assert gap["rotary"] < 0.5 * gap["fixed"] and gap["rotary"] < 0.5 * gap[None], gap

    with pytest.raises(ValueError, match="^kv_key_centers: rotary centres .* merge"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, merge=True, kv_residual=0,
                                                    kv_key_centers=str(paths["rotary"])))
    with pytest.raises(ValueError, match="^kv_key_centers: rotary centres .* packed store only"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=2, kv_demote="4:0.5",
                                                    kv_key_centers=str(paths["rotary"])))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(paths["rotary"].read_text()), "rotary": {"inv_freq": [1.0]}}))
    with pytest.raises(ValueError, match="^kv_key_centers: .* no valid RoPE frequencies"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4, kv_bits=4, kv_key_centers=str(bad)))


def test_eval_refuses_a_residual_that_does_not_fit_before_any_cell(capsys, tmp_path):
    from conftest import save_tiny_model

    tiny = str(save_tiny_model(tmp_path / "tiny"))
    capsys.readouterr()  # the saving's progress bar
    data = tmp_path / "text.txt"
    data.write_text("All the world's a stage, and all the men and women merely players. " * 30)
    code, _, err = _cli(capsys, "eval", "--model", tiny, "--methods", "full,scissorhands", "--budgets", "0.5",
                        "--tasks", "ppl", "--text", str(data), "--seq-len", "64", "--num-samples", "2",
                        "--recent", "0.1", "--kv-bits", "4", "--kv-residual", "8", "--out", str(tmp_path / "out"))
    assert code == 2 and err.strip().count("\n") == 0 and "kv-residual" in err
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_eval_records_count_each_layers_residual_from_the_schedule():
    """The plan's byte model, which eval's records use, takes each layer's residual from its own budget."""
    from scissorhands.hf.cache import cache_plan, memory_shape

    model = tiny_model("llama")  # 2 full layers, 2 KV heads of 16 channels, float32
    per_layer_token = 2 * 2 * 16 * 4
    shape = memory_shape(model)

    def residual(**settings):
        def held(**more):
            return cache_plan(model, CacheSettings(**settings, **more), budget=200).kv_bytes(shape)
        return held() - held(kv_residual=0)

    assert residual(kv_bits=4, schedule=(100, 300)) == (25 + 32) * per_layer_token  # recent 0.25 x 100 caps layer 0
    assert residual(kv_bits=4) == 2 * 32 * per_layer_token
    assert residual() == 0
