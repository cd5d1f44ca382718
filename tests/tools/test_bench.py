"""``scissorhands bench``: structure, arithmetic and argument checks on tiny models (no timing assertions)."""

import json

import pytest
import torch

from conftest import run_in_process, save_tiny_model, tiny_model
from scissorhands import CacheSettings
from scissorhands.tools.bench import BenchConfig, decode_point, parse_size, reference_ratios, run_bench
from scissorhands.tools.bench_capacity import max_fitting, maxbatch_part, soak_part
from scissorhands.tools.cli import main

SETTINGS = CacheSettings(recent=4)


def small(**kw):
    base = dict(contexts=(64, 128), batches=(1, 2), budgets=(0.5, 0.25), steps=3, warmup=1, prefill_chunk=32,
                prefill_contexts=(64,), repeats=1, cap_memory=4 * 2**20, fit="cache", cap_prompt=48, cap_new=4,
                cap_limit=8, soak_tokens=60, soak_budget=24, soak_every=6, soak_prompt=8, settings=SETTINGS,
                parts=("decode", "prefill", "maxbatch", "soak"))
    base.update(kw)
    return BenchConfig(**base)


def test_bench_json_structure():
    result = run_bench(tiny_model("llama"), small())
    json.loads(json.dumps(result))  # JSON-ready
    assert set(result) >= {"config", "machine", "decode", "prefill", "maxbatch", "soak", "peak_rss_bytes"}
    assert [(p["context"], p["batch"]) for p in result["decode"]] == [(64, 1), (64, 2), (128, 1), (128, 2)]
    for point in result["decode"]:
        names = [v["name"] for v in point["variants"]]
        assert names == ["full", "scissorhands 0.5", f"full at {round(0.5 * point['context'])}",
                         "scissorhands 0.25", f"full at {round(0.25 * point['context'])}"]
        for v in point["variants"]:
            assert len(v["step_s_all"]) == 3 and v["tokens_per_s"] > 0
            assert v["bytes_match"], v  # storage equals the analytic size, importance included
        assert [r["fraction"] for r in point["ratios"]] == [0.5, 0.25]
    prefill = {r["variant"] for r in result["prefill"]}
    assert {"full (SDPA)", "scissorhands, no eviction", "scissorhands 0.5, stream",
            "scissorhands 0.5, prompt-aware"} <= prefill
    assert [r["variant"] for r in result["maxbatch"]] == ["full", "scissorhands 0.5", "scissorhands 0.25"]
    assert result["config"]["settings"]["recent"] == 4


def test_decode_bytes_count_sliding_layers():
    """Gemma 3: the analytic size counts each sliding layer's window, and storage agrees."""
    point = decode_point(tiny_model("gemma3"), small(contexts=(64,), batches=(2,)), 64, 2)
    for v in point["variants"]:
        assert v["bytes_match"], v
    full = point["variants"][0]
    per_token = 2 * 16 * 4  # K + V, one KV head, head_dim 16, fp32
    assert full["measured"]["kv_bytes"] == 2 * (2 * 64 + 2 * 7) * per_token  # 2 full layers, 2 sliding (window 8)


@pytest.mark.parametrize("bits,key_bits,residual", [(4, None, 0), (4, 8, 0), (2, None, 0), (4, None, 3)])
def test_decode_bytes_of_a_packed_store_match_the_analytic_size(bits, key_bits, residual):
    """With --kv-bits the budgeted layers hold packed bytes + fp16 scales/zeros (+ the residual), and the bench
    counts them."""
    settings = CacheSettings(recent=4, kv_bits=bits, kv_key_bits=key_bits, kv_residual=residual)
    point = decode_point(tiny_model("llama"), small(contexts=(64,), batches=(2,), settings=settings), 64, 2)
    ours = [v for v in point["variants"] if v["name"].startswith("scissorhands")]
    assert ours
    for v in point["variants"]:
        assert v["bytes_match"], v
    # Llama tiny: 2 KV heads of 16 channels, one group each; K and V at their bits + 4 bytes of scale/zero.
    per_token_head = sum(16 * b // 8 + 4 for b in (key_bits or bits, bits))
    v = ours[0]
    residual_bytes = 2 * 2 * 2 * residual * 16 * 2 * 4  # layers x batch x heads x r x (K+V) channels, float32
    assert v["measured"]["kv_bytes"] == 2 * 2 * 2 * 32 * per_token_head + residual_bytes  # ... x budget


@pytest.mark.parametrize("rotary", [False, True])
def test_decode_bytes_with_key_centres_count_the_centres_once_per_layer(tmp_path, rotary):
    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    model = tiny_model("llama")
    path = tmp_path / "c.json"
    save_key_centers(measure_key_centers(model, lambda t: {"input_ids": [3 + b for b in t.encode()]}, "x y z " * 30,
                                         tokens=64, rotary=rotary), path)
    settings = CacheSettings(recent=4, kv_bits=4, kv_key_centers=str(path), kv_residual=0)
    point = decode_point(model, small(contexts=(64,), batches=(2,), settings=settings), 64, 2)
    for v in point["variants"]:
        assert v["bytes_match"], v
    ours = next(v for v in point["variants"] if v["name"].startswith("scissorhands"))
    per_token_head = 2 * (16 * 4 // 8 + 4) + (4 if rotary else 0)  # rotary: each slot's position
    per_layer = 2 * 16 * 4 + (8 * 4 if rotary else 0)  # the centres, and the RoPE frequencies of rotary ones
    assert ours["measured"]["kv_bytes"] == 2 * (2 * 2 * 32 * per_token_head + per_layer)


def test_reference_ratio_is_ours_over_the_full_cache_at_context_budget():
    rows = [{"name": "full", "cache": "full", "tokens_per_s": 10.0},
            {"name": "s 0.5", "cache": "scissorhands", "fraction": 0.5, "budget": 512, "tokens_per_s": 18.0},
            {"name": "full at 512", "cache": "full", "reference_for": 0.5, "tokens_per_s": 20.0},
            {"name": "s 0.2", "cache": "scissorhands", "fraction": 0.2, "budget": 205, "tokens_per_s": 27.0},
            {"name": "full at 205", "cache": "full", "reference_for": 0.2, "tokens_per_s": 30.0}]
    ratios = reference_ratios(rows)
    assert [r["vs_reference"] for r in ratios] == pytest.approx([0.9, 0.9])
    assert [r["vs_full"] for r in ratios] == pytest.approx([1.8, 2.7])
    assert ratios[1]["reference_tokens_per_s"] == 30.0 and ratios[1]["full_tokens_per_s"] == 10.0


@pytest.mark.parametrize("largest,limit", [(37, 100), (1, 100), (0, 100), (100, 100), (64, 100), (5, 5), (3, 1000)])
def test_max_fitting_finds_the_largest_batch_of_a_monotone_fit(largest, limit):
    best, trials = max_fitting(lambda b: b <= largest, limit)
    assert best == min(largest, limit)
    assert len(trials) <= 2 * limit.bit_length() + 2  # doubling, then bisection
    assert all(ok == (b <= largest) for b, ok in trials)


def test_maxbatch_under_a_cap_with_a_known_memory_function():
    """A fake trial whose memory is linear in the batch: the search and the ratios follow from the arithmetic."""
    cfg = small(cap_memory=1000, cap_prompt=80, cap_new=20, cap_limit=256, budgets=(0.5, 0.2))

    def trial(model, make_cache, batch, prompt, new, chunk, seed):
        cache = make_cache()
        held = cache.config.budget if hasattr(cache, "config") else prompt + new
        return {"batch": batch, "rss_growth_bytes": None, "cache_bytes": batch * held,
                "decode_tokens_per_s": float(batch), "seconds": 0.0}

    rows = maxbatch_part(tiny_model("llama"), cfg, trial)  # the first call is the discarded warm-up
    assert [r["max_batch"] for r in rows] == [1000 // 100, 1000 // 50, 1000 // 20]
    assert [r["batch_ratio"] for r in rows] == pytest.approx([1.0, 2.0, 5.0])
    assert [r["tokens_per_s_ratio"] for r in rows] == pytest.approx([1.0, 2.0, 5.0])
    assert all(r["used_bytes_at_max"] <= 1000 for r in rows)


def test_soak_memory_is_flat_once_the_cache_is_full():
    result = soak_part(tiny_model("llama"), small())
    filled = [r for r in result["records"] if r["seen"] > 24]
    assert result["flat"] and len(filled) >= 5
    assert len({r["cache_bytes"] for r in filled}) == 1  # bytes at the end == bytes after the cache filled
    assert result["records"][-1]["tokens"] == 60
    # the speed ratio compares equal windows of steady records: total tokens over total time in each
    steady = [r for r in result["records"] if r["seen"] > 24][1:]
    k = result["speed_window_tokens"] // 6
    assert 1 <= k <= len(steady) // 2

    def rate(rs):
        return len(rs) * 6 / sum(6 / r["tokens_per_s"] for r in rs)

    assert result["speed_last_over_first"] == pytest.approx(rate(steady[-k:]) / rate(steady[:k]))


def test_parse_size():
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == 1_500_000_000 and parse_size("4096") == 4096
    for bad in ("2XB", "-1GiB", "GiB", "nan", "0"):
        with pytest.raises(ValueError, match="^cap-memory: "):
            parse_size(bad)


@pytest.mark.parametrize("args,param", [
    (["--seq-len", "abc"], "seq-len"),
    (["--seq-len", "0,128"], "seq-len"),
    (["--batches", ""], "batches"),
    (["--budgets", "1.5"], "budgets"),
    (["--budgets", "nan"], "budgets"),
    (["--steps", "0"], "steps"),
    (["--steps", "2.5"], "steps"),
    (["--cap-memory", "2XB"], "cap-memory"),
    (["--memory", "2XB"], "memory"),
    (["--parts", "maxbatch"], "cap-memory"),
    (["--parts", "decode,warp"], "parts"),
    (["--parts", "soak"], "soak-tokens"),
    (["--fit", "vibes"], "fit"),
    (["--threads", "-1"], "threads"),
    (["--seq-len", "64", "--budgets", "0.1"], "seq-len"),
    (["--recent", "-1"], "recent"),
    (["--model", "/no/such/model"], "model"),
    (["--head-budgets", "heads.json"], "head-budgets"),
])
def test_bench_rejects_bad_arguments_in_one_line(capsys, tmp_path, args, param):
    code, err = run_in_process(capsys, "bench", "--out", str(tmp_path / "out"), *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and param in lines[0] and "Traceback" not in err, err


def test_bench_command_writes_json_tables_and_plots(capsys, tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    code = main(["bench", "--model", str(folder), "--seq-len", "64", "--batches", "1", "--budgets", "0.5",
                 "--steps", "2", "--warmup", "1", "--prefill-seq-len", "64", "--repeats", "1", "--cap-memory", "1MiB",
                 "--fit", "cache", "--cap-prompt", "32", "--cap-new", "4", "--cap-limit", "4", "--soak-tokens", "40",
                 "--soak-budget", "16", "--soak-every", "8", "--soak-prompt", "8", "--recent", "4", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert set(result["config"]["parts"]) == {"decode", "prefill", "maxbatch", "soak"}
    for name in ("tables.md", "throughput.png", "memory.png", "max_batch.png"):
        assert (out / name).stat().st_size > 0
    assert "vs reference" in capsys.readouterr().out


def test_bench_takes_methods_as_eval_does(tmp_path):
    """Several methods at each budget in one interleaved run, each with the method's own settings."""
    folder = save_tiny_model(tmp_path / "tiny")
    code = main(["bench", "--model", str(folder), "--seq-len", "64", "--batches", "1", "--budgets", "0.5",
                 "--methods", "scissorhands,tova", "--steps", "2", "--warmup", "1", "--parts", "decode",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = [v["name"] for v in result["decode"][0]["variants"]]
    assert names == ["full", "scissorhands 0.5", "tova 0.5", "full at 32"]
    assert [r["method"] for r in result["decode"][0]["ratios"]] == ["scissorhands", "tova"]
    assert all(v["bytes_match"] for v in result["decode"][0]["variants"])


def test_a_folder_holding_an_earlier_run_is_refused_or_replaced_whole(capsys, tmp_path):
    """A second bench into one folder is refused; with --replace, no file of the earlier run survives."""
    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    quick = ["bench", "--model", str(folder), "--seq-len", "64", "--batches", "1", "--budgets", "0.5", "--steps",
             "2", "--warmup", "1", "--out", str(out)]
    assert main([*quick, "--parts", "decode,maxbatch", "--cap-memory", "1MiB", "--fit", "cache", "--cap-prompt", "32",
                 "--cap-new", "4", "--cap-limit", "2"]) == 0
    assert (out / "max_batch.png").exists()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    code, err = run_in_process(capsys, *quick, "--parts", "decode")
    assert code == 2 and err.strip().splitlines() == [
        f"scissorhands: error: out: {str(out)!r} holds an earlier bench run (bench.json); give another folder, or "
        "--replace to replace that run"], err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    assert main([*quick, "--parts", "decode", "--replace"]) == 0
    assert not (out / "max_batch.png").exists()  # no plot of a part this run did not measure
    assert set(json.loads((out / "bench.json").read_text())["config"]["parts"]) == {"decode"}


def test_ctrl_c_keeps_the_points_already_measured(capsys, tmp_path, monkeypatch):
    import scissorhands.tools.bench as bench

    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    real, calls = bench.decode_point, []

    def interrupted_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(bench, "decode_point", interrupted_second)
    code = main(["bench", "--model", str(folder), "--seq-len", "32,64", "--batches", "1", "--budgets", "0.5",
                 "--steps", "2", "--warmup", "1", "--parts", "decode", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130
    assert err.rstrip().endswith("scissorhands: interrupted"), err
    result = json.loads((out / "bench.json").read_text())
    assert result["interrupted"] is True
    assert [p["context"] for p in result["decode"]] == [32]
    assert (out / "tables.md").read_text().count("| 32 |") >= 1


def test_bench_measures_memory_budgets_beside_token_budgets(tmp_path):
    """--memory adds a decode variant per method whose store and budget are chosen for the context, with the
    full cache at that budget as its reference, and the bytes from storage equal to the analytic count."""
    folder = save_tiny_model(tmp_path / "tiny")
    code = main(["bench", "--model", str(folder), "--seq-len", "128", "--batches", "1", "--budgets", "0.5",
                 "--memory", "0.2", "--steps", "2", "--warmup", "1", "--parts", "decode", "--out", str(tmp_path / "o")])
    assert code == 0
    point = json.loads((tmp_path / "o" / "bench.json").read_text())["decode"][0]
    mem = next(v for v in point["variants"] if v["name"] == "scissorhands memory=0.2")
    assert mem["memory_choice"]["peak_bytes"] <= mem["memory_choice"]["target_bytes"]
    assert mem["bytes_match"]
    assert any(v.get("reference_for") == "memory=0.2" for v in point["variants"])
    assert [r["fraction"] for r in point["ratios"]] == [0.5, "memory=0.2"]
    assert "memory=0.2" in (tmp_path / "o" / "tables.md").read_text()


def test_bench_prefill_with_prompt_chunk_adds_the_chunked_variant():
    """``--prompt-chunk`` (with prefill='prompt-aware' in the settings) times the chunked prefill beside the
    streamed and the held one; the streamed variant does not take the chunk (it would be refused)."""
    from dataclasses import replace

    settings = replace(SETTINGS, prefill="prompt-aware", prompt_chunk=16)
    result = run_bench(tiny_model("llama"), small(parts=("prefill",), settings=settings))
    prefill = {r["variant"]: r for r in result["prefill"]}
    assert {"scissorhands 0.25, stream", "scissorhands 0.25, prompt-aware",
            "scissorhands 0.25, prompt-aware, chunk 16"} <= set(prefill)
    assert all(r["seconds"] > 0 for r in prefill.values())


def test_repeat_rows_prefills_once_per_context_and_times_every_batch_on_copies(monkeypatch):
    """--repeat-rows: one prompt per variant and context; each batch size gets copies of its caches with the row
    repeated, so the bytes are the batch's, every row decodes the same tokens, and the prompt is fed once."""
    import scissorhands.tools.bench as bench

    model = tiny_model("llama")
    fed = []
    real = bench.prefill
    monkeypatch.setattr(bench, "prefill", lambda m, ids, cache, chunk: fed.append(ids.shape) or real(m, ids, cache,
                                                                                                       chunk))
    cfg = small(contexts=(64,), batches=(1, 3), parts=("decode",), repeat_rows=True)
    result = run_bench(model, cfg)
    variants = len(result["decode"][0]["variants"])
    assert len(fed) == variants and all(shape[0] == 1 for shape in fed)  # one row per variant, once per context
    one, three = result["decode"]
    for a, b in zip(one["variants"], three["variants"]):
        assert b["bytes_match"], b
        assert b["prefill_rows"] == 1 and b["measured"]["kv_bytes"] == 3 * a["measured"]["kv_bytes"]
    # The repeated rows decode as the one row did: a batch of 3 copies of the same prompt.
    prefilled = bench.prefill_variants(model, cfg, 64, 1)
    _, copies = bench._repeated(prefilled, 3)
    with torch.no_grad():
        nxt = [bench.forward(model, s["next"], s["cache"]) for s in copies]
        alone = [bench.forward(model, s["next"], s["cache"]) for s in prefilled[1]]
    for rows, row in zip(nxt, alone):
        assert rows.shape == (3, 1) and torch.equal(rows, row.expand(3, 1))
    for s in prefilled[1]:  # the originals were copied, not repeated in place
        assert s["next"].shape[0] == 1


def test_repeat_rows_from_the_command_line(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    code = main(["bench", "--model", str(folder), "--seq-len", "48", "--batches", "1,2", "--budgets", "0.5",
                 "--steps", "2", "--warmup", "1", "--parts", "decode", "--repeat-rows", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["config"]["repeat_rows"] is True
    assert [v["prefill_rows"] for p in result["decode"] for v in p["variants"]] == [1] * 6
    assert "one prompt's caches repeated" in (out / "tables.md").read_text()
