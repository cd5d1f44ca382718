"""Persistence, power law, calibration, bound and the analyze command, on hand examples and tiny models."""

import argparse
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import ByteTokenizer
from scissorhands import ScissorhandsCache, ScissorhandsConfig, layer_budgets
from scissorhands.tools.analysis import (
    AnalysisSettings,
    attention_maps,
    calibrated_budgets,
    deviation_vs_budget,
    eager_copy,
    fit_power_law,
    random_copy,
    rank_frequency,
    save_schedule,
    topk_persistence,
    union_persistence,
)
from scissorhands.tools.analysis.cli import add_parser, run
from scissorhands.tools.analysis.persistence import layer_persistence

# One head, T = 6 (first half = keys 0, 1, 2). Rows are steps t = 1..6.
HAND = torch.tensor([[
    [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.6, 0.4, 0.0, 0.0, 0.0, 0.0],
    [0.5, 0.1, 0.4, 0.0, 0.0, 0.0],
    [0.1, 0.5, 0.1, 0.3, 0.0, 0.0],
    [0.3, 0.1, 0.1, 0.1, 0.4, 0.0],
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
]])


def tiny_llama(seed=0, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def causal_softmax(logits):
    """Row-wise softmax over the causal part.  logits (H, T, T) -> (H, T, T)."""
    t = logits.shape[-1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return logits.masked_fill(~mask, -math.inf).softmax(-1)


def naive_union(attn, multiple):
    """Form (a) by a plain loop over steps, for one head (T, T)."""
    t_len = attn.shape[0]
    half = t_len // 2
    early, late = set(), set()
    for t in range(1, t_len + 1):
        heavy = {j for j in range(t) if attn[t - 1, j] > multiple / t}
        if t <= half:
            early |= heavy
        else:
            late |= {j for j in heavy if j < half}
    return (len(late & early) / len(late)) if late else math.nan


def naive_topk(attn, k):
    """Form (b) by sorting Python lists, for one head (T, T)."""
    half = attn.shape[0] // 2
    first = [sum(float(attn[i, j]) for i in range(half)) for j in range(half)]
    second = [sum(float(attn[i, j]) for i in range(half, attn.shape[0])) for j in range(half)]
    n = max(1, round(k * half))
    top1 = set(sorted(range(half), key=lambda j: -first[j])[:n])
    top2 = set(sorted(range(half), key=lambda j: -second[j])[:n])
    return len(top1 & top2) / n


# ------------------------------------------------------------------ persistence

def test_union_form_on_hand_example():
    # E = {0, 2} (t=2: key 0 > 1/2; t=3: keys 0, 2 > 1/3); L = ({1, 3} u {0, 4} u {5}) & {0, 1, 2} = {0, 1}
    res = union_persistence(HAND, multiple=1.0)
    assert res["ratio"].tolist() == pytest.approx([0.5])
    assert res["coverage"].tolist() == pytest.approx([2 / 3])
    assert res["late"].tolist() == pytest.approx([2 / 3])
    # at 2/t nothing in the second half exceeds the threshold on keys 0..2: L is empty, the ratio undefined
    assert math.isnan(union_persistence(HAND, multiple=2.0)["ratio"].item())


def test_topk_form_on_hand_example():
    # first-half sums of keys 0, 1, 2: 2.1, 0.5, 0.4; second-half sums: 0.5, 0.7, 0.3
    assert topk_persistence(HAND, k=1 / 3).item() == pytest.approx(0.0)  # {0} vs {1}
    assert topk_persistence(HAND, k=2 / 3).item() == pytest.approx(1.0)  # {0, 1} vs {1, 0}
    # relative to uniform, key 2 beats key 1 in the first half: {0, 2} vs {1, 0}
    assert topk_persistence(HAND, k=2 / 3, normalise=True).item() == pytest.approx(0.5)


def test_both_forms_match_naive_loops_on_random_maps():
    gen = torch.Generator().manual_seed(1)
    attn = causal_softmax(torch.randn(3, 40, 40, generator=gen) * 2.0)
    for m in (1.0, 2.0, 5.0):
        got = union_persistence(attn, m)["ratio"]
        want = torch.tensor([naive_union(attn[h], m) for h in range(3)])
        torch.testing.assert_close(got, want, equal_nan=True)
    for k in (0.05, 0.1, 0.3):
        got = topk_persistence(attn, k)
        want = torch.tensor([naive_topk(attn[h], k) for h in range(3)])
        torch.testing.assert_close(got, want)


def test_sliding_window_threshold_counts_only_visible_tokens():
    # Uniform attention over a window of 4: every row is exactly 1/n_t, so with n_t = min(t, 4)
    # no key exceeds the threshold, while 1/t for long rows would flag them all.
    t_len, w = 12, 4
    i = torch.arange(t_len).view(-1, 1)
    j = torch.arange(t_len).view(1, -1)
    vis = (j <= i) & (i - j < w)
    attn = (vis.float() / vis.sum(-1, keepdim=True)).unsqueeze(0)
    assert union_persistence(attn, 1.0, window=w)["late"].item() == 0.0
    assert union_persistence(attn, 1.0, window=None)["late"].item() > 0.0


def planted_maps(heads=4, t_len=64, columns=(3, 10, 17), seed=0):
    """Attention where a few fixed early columns dominate every query that can see them."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(heads, t_len, t_len, generator=gen)
    logits[:, :, list(columns)] += 6.0
    return causal_softmax(logits)


def test_planted_pattern_persists_and_a_random_model_does_not():
    planted = layer_persistence(planted_maps(), thresholds=[2.0], topk=[0.1])
    assert planted["b@0.1"].min().item() == 1.0
    assert planted["a@2"].min().item() == 1.0

    model = eager_copy(tiny_llama())
    ids = torch.randint(3, 256, (64,), generator=torch.Generator().manual_seed(0))
    maps = attention_maps(model, ids)
    rand = torch.stack([layer_persistence(a, thresholds=[2.0], topk=[0.1])["b@0.1"] for a in maps])
    assert rand.mean().item() < 0.7  # planted: 1.0
    assert rand.mean().item() < planted["b@0.1"].mean().item() - 0.3


def test_attention_maps_are_per_query_head_and_leave_the_model_alone():
    model = tiny_llama()
    state = torch.random.get_rng_state()
    twin = random_copy(model, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert model.config._attn_implementation == "sdpa"
    maps = attention_maps(eager_copy(model), torch.arange(3, 23))
    assert model.config._attn_implementation == "sdpa"
    assert len(maps) == 2 and maps[0].shape == (4, 20, 20)  # 4 query heads, though only 2 KV heads
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(4, 20))
    assert torch.equal(maps[0], maps[0].tril())
    # the control is a different draw of the same architecture
    assert not torch.equal(twin.lm_head.weight, model.lm_head.weight)
    assert twin.lm_head.weight.shape == model.lm_head.weight.shape


# ------------------------------------------------------------------ power law

def test_power_law_fit_recovers_a_known_exponent():
    gen = np.random.default_rng(0)
    ranks = np.arange(1, 2001)
    values = 5.0 * ranks ** -1.3 * np.exp(gen.normal(0, 0.02, ranks.size))
    alpha, r2 = fit_power_law(values, 2, 1000)
    assert alpha == pytest.approx(1.3, abs=0.01)
    assert r2 > 0.99
    # an exponential decay is not a power law: the fit says so
    _, r2_exp = fit_power_law(np.exp(-ranks / 100.0), 2, 1000)
    assert r2_exp < 0.9


def test_rank_frequency_sorts_column_sums():
    freq = rank_frequency(HAND)
    assert freq.shape == (1, 6)
    assert freq[0].tolist() == pytest.approx([2.6, 1.2, 0.7, 0.5, 0.5, 0.5])  # column sums, descending
    assert freq.sum().item() == pytest.approx(6.0)


# ------------------------------------------------------------------ calibration

def test_calibrated_schedule_sums_floors_and_favours_low_persistence():
    persistence = [0.9, 0.2, 0.5, 0.99]
    budgets = calibrated_budgets(persistence, budget=40, recent=10, weight_floor=0.1)
    assert sum(budgets) == 40 * 4
    assert all(b >= 11 for b in budgets)
    order = sorted(range(4), key=lambda i: persistence[i])
    assert [budgets[i] for i in order] == sorted(budgets, reverse=True)
    # a tight total drives the weights below the floor: the floor holds and the total still adds up
    tight = calibrated_budgets([0.0, 0.95, 0.95, 0.95], budget=12, recent=10, weight_floor=0.0)
    assert sum(tight) == 48 and min(tight) >= 11
    with pytest.raises(ValueError, match="^budget:"):
        calibrated_budgets(persistence, budget=5, recent=10)


def test_calibrated_json_is_accepted_by_the_cache(tmp_path):
    model = tiny_llama(layers=3)
    budgets = calibrated_budgets([0.8, 0.3, 0.6], budget=24, recent=4)
    path = save_schedule(tmp_path / "calibrated.json", budgets, "test")
    data = json.loads(path.read_text())
    assert data["budgets"] == budgets and "method" in data and data["source"] == "test"

    config = ScissorhandsConfig(budget=24, recent=4, schedule=str(path))
    assert layer_budgets(config, 3) == budgets  # same total: the schedule is used as written
    half = layer_budgets(ScissorhandsConfig(budget=12, recent=4, schedule=str(path)), 3)
    assert sum(half) == 36 and half[1] == max(half)  # other total: the shape carries over

    cache = ScissorhandsCache(model, config)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 46)
    assert [layer.budget for layer in cache.budgeted_layers] == budgets
    assert all(layer.slots.peak <= b for layer, b in zip(cache.budgeted_layers, budgets))


# ------------------------------------------------------------------ bound

def test_deviation_is_zero_without_eviction_and_grows_with_it():
    model = tiny_llama()
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(2))
    rows = deviation_vs_budget(model, ids, [0.3, 1.0], ScissorhandsConfig(budget=100, recent=4))
    small, full = rows
    assert full["budget"] == 48
    assert max(full["layer_rel_l2"]) < 1e-5 and full["kl"] < 1e-6
    assert small["budget"] == 14
    assert min(small["layer_rel_l2_evicted"]) > 1e-3 and small["kl_evicted"] > 0
    assert small["layer_rel_l2"][0] < small["layer_rel_l2_evicted"][0]  # the first B positions match exactly


# ------------------------------------------------------------------ the analyze command

def parse(*argv):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["analyze", *argv])


@pytest.mark.parametrize("argv, name", [
    (["--seq-len", "3"], "seq-len"),
    (["--num-samples", "0"], "num-samples"),
    (["--thresholds", "0"], "thresholds"),
    (["--topk", "150"], "topk"),
    (["--calib-topk", "7"], "calib-topk"),
    (["--ratios", "0.5,1.5"], "ratios"),
    (["--budget", "-1"], "budget"),
    (["--compressions", "0.5"], "compressions"),
    (["--calib-fraction", "1"], "calib-fraction"),
    (["--parts", "persistence,nope"], "parts"),
    (["--parts", "calibrate"], "parts"),
    (["--text", "/no/such/file.txt"], "text"),
    (["--from-json", "/no/such/analysis.json"], "from-json"),
])
def test_analyze_rejects_bad_arguments_with_one_line(argv, name):
    with pytest.raises(ValueError) as err:
        run(parse(*argv, "--model", "/no/such/model.gguf"))
    msg = str(err.value)
    assert msg.startswith(f"{name}: ") and "\n" not in msg


@pytest.mark.parametrize("argv, name", [(["--seq-len", "64,abc"], "seq-len"), (["--seed", "x"], "seed"),
                                        (["--topk", "5,,x"], "topk")])
def test_analyze_options_that_do_not_parse_are_argparse_one_line_errors(capsys, argv, name):
    """Typed options, as every command's: the parser refuses them, naming the option, before anything runs."""
    from scissorhands.tools.cliargs import Parser

    parser = Parser(prog="scissorhands")
    add_parser(parser.add_subparsers(dest="command", parser_class=Parser))
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["analyze", *argv])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and len(err.splitlines()) == 1 and f"argument --{name}" in err, err


@pytest.mark.parametrize("field, option", [("bound_windows", "bound-samples"), ("ppl_windows", "ppl-samples"),
                                           ("windows", "num-samples")])
def test_more_samples_than_the_text_holds_are_refused_naming_the_option(tmp_path, field, option):
    from scissorhands.tools.analysis.pipeline import analyze

    text = " ".join(f"line {i}: the quick brown fox {i % 7} jumps." for i in range(40))  # ~1,600 bytes
    fields = {"windows": 2, "bound_windows": 1, "ppl_windows": 2, field: 1000}
    settings = AnalysisSettings(seq_lens=(32, 64), ppl_seq_len=48, compressions=(2.0,), **fields)
    with pytest.raises(ValueError) as err:
        analyze(tiny_llama(), ByteTokenizer(), [("t", text)], settings, tmp_path, "tiny", progress=False)
    assert str(err.value).startswith(f"{option}: the text holds ") and "fewer than the 1000 asked" in str(err.value)
    assert not list(tmp_path.iterdir())  # refused before anything was measured or written


def test_pipeline_end_to_end_on_a_tiny_model(tmp_path):
    from scissorhands.tools.analysis.pipeline import analyze
    from scissorhands.tools.analysis.report import summary, write_plots

    model = tiny_llama()
    text = " ".join(f"line {i}: the quick brown fox {i % 7} jumps." for i in range(120))
    settings = AnalysisSettings(seq_lens=(32, 64), windows=2, thresholds=(1.0, 2.0), topk=(0.1, 0.25),
                                calib_topk=0.1, budget=0.5, ratios=(0.5, 1.0), bound_windows=1, ppl_seq_len=48,
                                ppl_windows=2, compressions=(2.0,))
    result = analyze(model, ByteTokenizer(), [("t", text)], settings, tmp_path, "tiny", progress=False)
    trained = result["measured"]["trained"]["persistence"]
    assert set(trained) == {"32", "64"} and len(trained["64"]["b@0.1"]["mean"]) == 2
    cal = result["calibration"]
    assert sum(cal["budgets"]) == 24 * 2 and json.loads((tmp_path / "calibrated_schedule.json").read_text())
    assert result["bound"][-1]["mean_rel_l2"] < 1e-5
    names = {r["schedule"] for r in result["ppl"]["runs"]}
    assert names == {"uniform", "increasing", "calibrated"}
    assert [p.name for p in write_plots(result, tmp_path)] == ["persistence.png", "powerlaw.png", "bound.png",
                                                              "schedule.png"]
    assert "calibrated budgets" in summary(result)

    # the command redraws plots and tables from the saved result without measuring anything
    from scissorhands.tools.analysis.report import save_json

    save_json(result, tmp_path / "analysis.json")
    assert run(parse("--from-json", str(tmp_path / "analysis.json"), "--out", str(tmp_path / "redrawn"))) == 0
    tables = (tmp_path / "redrawn" / "tables.md").read_text()
    assert "| 1 | full |" in tables and "Fits through the origin" in tables
    assert (tmp_path / "redrawn" / "bound.png").is_file()


def test_bos_windows_keep_their_length_and_need_a_bos_token():
    from scissorhands.tools.analysis.pipeline import with_bos

    class Tok:
        bos_token_id = 7

    assert with_bos([[1, 2, 3, 4]], Tok()) == [[7, 1, 2, 3]]
    with pytest.raises(ValueError, match="^bos: "):
        with_bos([[1, 2, 3]], ByteTokenizer())


def test_fit_through_origin_recovers_a_slope():
    from scissorhands.tools.analysis.bound import fit_through_origin

    slope, r2 = fit_through_origin([0.0, 0.3, 0.5, 0.9], [0.0, 0.6, 1.0, 1.8])
    assert slope == pytest.approx(2.0) and r2 == pytest.approx(1.0)
    _, r2_bad = fit_through_origin([0.0, 0.3, 0.5, 0.9], [1.0, 0.0, 1.0, 0.0])
    assert r2_bad < 0.5
