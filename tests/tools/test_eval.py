"""Evaluation tasks and the grid runner on tiny models and real text."""

import json

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from scissorhands import ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs
from scissorhands.tools.cli import main
from scissorhands.tools.eval import make_task, plot_results, run_grid, summary_table
from scissorhands.tools.eval.report import paired_vs_full
from scissorhands.tools.eval.tasks import Agreement, MultipleChoice, Perplexity
from scissorhands.tools.generation import demo_prompt

BASE = ScissorhandsConfig(budget=16, recent=4, drop=0.4, window=16, importance="sum")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "hamlet.txt"
    path.write_text(demo_prompt())
    return path


def test_perplexity_grid_writes_results_tables_and_plots(tmp_path, text_file):
    model = tiny_model("llama")
    task = Perplexity(seq_len=96, n_windows=3, data=str(text_file))
    methods = [get_method(m) for m in ("full", "scissorhands", "streaming")]
    out = tmp_path / "out"
    results = run_grid(model, ByteTokenizer(), model_name="tiny-llama", tasks=[task], methods=methods,
                       budgets=[0.25, 1.0], base=BASE, out_dir=out)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == len(results) == 5
    rec = next(r for r in lines if r["method"] == "scissorhands" and r["budget"] == 0.25)
    assert rec["compression"] == pytest.approx(4.0) and rec["n_items"] == 3
    assert rec["kv_bytes"] * 4 == pytest.approx(rec["full_kv_bytes"])
    assert {"ppl", "nll", "ppl_ci95"} <= set(rec["metrics"]) and rec["config"]["importance"] == "sum"
    # A budget of the whole window is the full cache, exactly.
    full = next(r for r in lines if r["method"] == "full")
    whole = next(r for r in lines if r["method"] == "scissorhands" and r["budget"] == 1.0)
    assert whole["metrics"]["nll"] == pytest.approx(full["metrics"]["nll"], abs=1e-6)
    assert "scissorhands" in summary_table(results)
    assert all(p["delta_nll_ci95"] >= 0 for p in paired_vs_full(results))
    assert plot_results(results, out) == [out / "ppl.png"] and (out / "ppl.png").stat().st_size > 1000
    # Resuming reuses finished results instead of recomputing them.
    again = run_grid(model, ByteTokenizer(), model_name="tiny-llama", tasks=[task], methods=methods,
                       budgets=[0.25, 1.0], base=BASE, out_dir=out)
    assert [r["wall_s"] for r in again] == [r["wall_s"] for r in results]


def test_multiple_choice_from_jsonl_matches_brute_force(tmp_path):
    model = tiny_model("qwen2")
    path = tmp_path / "qa.jsonl"
    qs = [{"context": "Question: what grows in a garden? Answer:" * 3, "choices": [" roses", " stones", " a car"],
           "label": 0},
          {"context": "The sun rises in the", "choices": [" east", " west"], "label": 0},
          {"context": "To be, or not to be, that is the", "choices": [" question", " answer", " tea"], "label": 0}]
    path.write_text("\n".join(json.dumps(q) for q in qs))
    task = make_task(str(path))
    assert isinstance(task, MultipleChoice)
    tok = ByteTokenizer()
    items = task.items(tok, None)
    setup = ScoreSetup(get_method("scissorhands"), 24, BASE)
    for item, q in zip(items, qs):
        got = task.score(model, item, setup)
        totals = []
        for choice in q["choices"]:
            ctx, cont = tok(q["context"]).input_ids, tok(choice).input_ids
            lp, _ = token_logprobs(model, torch.tensor(ctx + cont), setup)
            totals.append(float(lp[-len(cont):].sum()))
        assert got["correct"] == (max(range(len(totals)), key=totals.__getitem__) == q["label"])
    metrics = task.aggregate([task.score(model, i, setup) for i in items])
    assert 0 <= metrics["acc"] <= 1 and metrics["n"] == 3


def test_agreement_is_total_without_eviction_and_drops_with_it(text_file):
    model = tiny_model("llama")
    task = Agreement(prompt_len=60, new_tokens=12, n_prompts=2, data=str(text_file))
    items = task.items(ByteTokenizer(), None)
    whole = [task.score(model, i, ScoreSetup(get_method("scissorhands"), 72, BASE)) for i in items]
    assert all(s["first_divergence"] == 12 and s["agreement"] == 1.0 for s in whole)
    tight = [task.score(model, i, ScoreSetup(get_method("local"), 11, BASE)) for i in items]
    assert all(0 <= s["first_divergence"] <= 12 for s in tight)


def test_real_task_data_is_read():
    task = make_task("piqa")
    items = task.items(ByteTokenizer(), 3)
    assert len(items) == 3 and all(len(i.data["cont"]) == 2 for i in items)
    assert make_task("lambada").items(ByteTokenizer(), 2)[0].data["cont"]


@pytest.mark.parametrize("args,param", [
    (["--tasks", "nope"], "tasks"),
    (["--budgets", "0.2,x"], "budgets"),
    (["--budgets", "-1"], "budgets"),
    (["--methods", "magic"], "methods"),
    (["--text", "/no/such/dir"], "text"),
    (["--recent", "-1"], "recent"),
    (["--limit", "0"], "limit"),
])
def test_eval_cli_rejects_bad_arguments_in_one_line(capsys, args, param):
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{param}:" in lines[0] and "Traceback" not in err


def test_a_task_file_with_a_byte_order_mark_reads_as_without(tmp_path):
    q = {"context": "The sun rises in the", "choices": [" east", " west"], "label": 0}
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_text(json.dumps(q) + "\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    tok = ByteTokenizer()
    a, b = make_task(str(plain)).items(tok, None), make_task(str(marked)).items(tok, None)
    assert [(i.key, i.data) for i in a] == [(i.key, i.data) for i in b] and len(a) == 1


def test_the_plugin_settings_of_a_cell_carry_a_modes_own_settings():
    """``--engine vllm`` hands the plugin every setting that differs from the default, a prefill mode's own
    (``observe``, ``pool``, kept apart from the fields) included, and the plugin builds the cell's settings from
    them; one it cannot run (a kept fraction of the prompt) is refused naming that setting."""
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval.engine import plugin_settings
    from scissorhands.vllm.settings import parse

    method = get_method("scissorhands")
    base = CacheSettings(recent=0.5, rounds=True, prefill="prompt-aware", observe=16, pool=3)
    given = plugin_settings(method, 96, base)
    assert given["observe"] == 16 and given["pool"] == 3 and given["recent"] == 0.5
    made = parse(given).config
    for name in ("recent", "rounds", "prefill", "observe", "pool", "drop"):
        assert getattr(made, name) == getattr(base, name), name
    assert made.budget == 96
    with pytest.raises(ValueError, match=r"^prompt_keep: "):
        plugin_settings(method, 96, CacheSettings(rounds=True, prefill="keep-prompt", prompt_keep=80))
