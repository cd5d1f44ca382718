"""The experiments folder stays runnable: every script answers --help, its configs parse, the docs' paths exist."""

import importlib
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("*.py"))
CONFIGS = sorted((EXPERIMENTS / "configs").glob("*.json"))
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_the_folder_has_scripts_and_configs():
    assert SCRIPTS
    assert CONFIGS
    assert not list(EXPERIMENTS.glob("*.json")), "sweep configs go in experiments/configs/"


# Runs each script as ``python SCRIPT --help`` does (``runpy`` as ``__main__``, its folder first on the path), all in
# one interpreter, so that torch and transformers are imported once rather than once per script.
_HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys, traceback
sys.path.insert(0, sys.argv[1])
answers = {}
for path in sys.argv[2:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    answers[path] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers():
    proc = subprocess.run([sys.executable, "-c", _HELP_RUNNER, str(EXPERIMENTS), *map(str, SCRIPTS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script, help_answers):
    answer = help_answers[str(script)]
    assert answer["code"] == 0, answer["stderr"][-2000:]
    assert answer["stdout"].startswith("usage:"), answer["stdout"][:200] + answer["stderr"][-2000:]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config):
    json.loads(config.read_text())


def _mentioned(pattern):
    found = set()
    for doc in DOCS:
        if doc.exists():
            found.update(re.findall(pattern, doc.read_text(encoding="utf-8")))
    return sorted(found)


def test_config_paths_in_the_docs_exist():
    paths = _mentioned(r"experiments/configs/[\w.-]+\.json")
    assert paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, missing


def test_script_paths_in_the_docs_exist():
    paths = _mentioned(r"experiments/\w+\.py")
    assert paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, missing


def script(name: str):
    """An experiments/ script imported as a module, to call its main() in this process."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))


def test_paired_runs_against_one_method_pairs_each_peer_window_by_window(tmp_path, capsys):
    """``paired_runs.py RUN --against METHOD``: METHOD - peer per budget, paired over the same windows."""
    paired_runs = script("paired_runs")
    ours, h2o, full = [3.0, 3.2, 3.1], [3.1, 3.5, 3.1], [2.9, 3.0, 3.0]
    rows = [("full", None, full), ("scissorhands", 0.2, ours), ("h2o", 0.2, h2o), ("h2o", 0.1, h2o)]
    (tmp_path / "results.jsonl").write_text("".join(
        json.dumps({"task": "ppl", "method": m, "budget": b, "metric": "ppl", "value": 0.0,
                    "item_scores": [{"nll": v} for v in vals]}) + "\n"
        for m, b, vals in rows))
    assert paired_runs.main([str(tmp_path), "--against", "scissorhands"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ppl")]
    assert len(lines) == 1 and lines[0].startswith("| ppl | 0.2 | -0.1333 ±") and lines[0].endswith("| h2o |")
    assert paired_runs.main([str(tmp_path), "--against", "tova"]) == 2
    with pytest.raises(SystemExit):
        paired_runs.main([str(tmp_path)])


def test_paired_runs_picks_one_of_a_methods_rows_by_its_settings_and_tests_pass_rates(tmp_path, capsys):
    """Two runs of one method into one folder (``--prefill`` then ``--preset paper``): ``--where`` picks ours, the
    other is a peer named by its settings; right-or-wrong items get McNemar's p beside the paired difference."""
    paired_runs = script("paired_runs")
    ours, paper, h2o = [1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 1]
    rows = [("scissorhands", {"prefill": "stream", "importance": "mean"}, ours),
            ("scissorhands", {"prefill": "stream", "importance": "sum"}, paper),
            ("h2o", {"prefill": "stream", "importance": "sum"}, h2o)]
    (tmp_path / "results.jsonl").write_text("".join(
        json.dumps({"task": "humaneval", "method": m, "budget": 0.2, "metric": "pass@1", "value": 0.0,
                    "config": config, "item_scores": [{"passed": float(v)} for v in vals]}) + "\n"
        for m, config, vals in rows))
    assert paired_runs.main([str(tmp_path), "--against", "scissorhands"]) == 2  # two rows: which is ours?
    assert paired_runs.main([str(tmp_path), "--against", "scissorhands", "--where", "importance=mean"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| humaneval")]
    half = [1.96 * statistics.stdev([a - b for a, b in zip(ours, peer)]) / 2 for peer in (h2o, paper)]  # n = 4
    # McNemar: against h2o one item each way (p = 1); against the paper row two of ours alone (p = 2 / 2**2)
    assert lines == [f"| humaneval | 0.2 | +0.0000 ±{half[0]:.4f} | 1 | h2o |",
                     f"| humaneval | 0.2 | +0.5000 ±{half[1]:.4f} | 0.5 | scissorhands (importance=sum) |"], lines


def test_defaults_sweep_resumes_its_own_run_and_refuses_another(tmp_path, capsys):
    """A second run into the same file adds only new rows; a changed dtype, model or window set is refused."""
    from conftest import save_tiny_model

    defaults_sweep = script("defaults_sweep")
    model = str(save_tiny_model(tmp_path / "tiny"))
    settings = tmp_path / "s.json"
    settings.write_text(json.dumps({"defaults": {}, "sum": {"importance": "sum"}}))
    out = tmp_path / "sweep.jsonl"
    base = ["--model", model, "--settings", str(settings), "--seq-len", "48", "--num-samples", "2", "--out", str(out)]
    defaults_sweep.main([*base, "--budgets", "0.5"])
    first = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["name"], r["budget"], r["dtype"], r["model"]) for r in first] == [
        ("defaults", 0.5, "float32", model), ("sum", 0.5, "float32", model)]
    assert json.loads(out.with_suffix(".full.json").read_text())["dtype"] == "float32"
    defaults_sweep.main([*base, "--budgets", "0.5,0.25"])  # resumes: only the new budget is scored
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[:2] == first and [(r["name"], r["budget"]) for r in rows[2:]] == [("defaults", 0.25), ("sum", 0.25)]
    for flag, value in [("--dtype", "bfloat16"), ("--num-samples", "3"), ("--seq-len", "40")]:
        args = [*base, flag, value]  # the later option wins
        with pytest.raises(SystemExit) as err:
            defaults_sweep.main([*args, "--budgets", "0.5"])
        assert str(err.value).startswith(f"{flag}: ") and "\n" not in str(err.value)
    assert out.read_text().count("\n") == 4  # nothing was added by the refused runs


def _passkey_grid_run(tmp_path, out_name):
    """The script, a tiny model's folder, a one-cell (full cache) file and the output path."""
    from conftest import save_tiny_model

    model = str(save_tiny_model(tmp_path / "tiny"))
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([{"name": "full", "method": "full", "budget": None}]))
    return script("passkey_grid"), model, cells, tmp_path / out_name


def test_passkey_grid_resumes_its_own_run_and_refuses_other_lengths(tmp_path):
    passkey_grid, model, cells, out = _passkey_grid_run(tmp_path, "pk.jsonl")
    base = ["--model", model, "--cells", str(cells), "--depths", "0.5", "--out", str(out)]
    passkey_grid.main([*base, "--lengths", "300"])
    first = out.read_text()
    rec = json.loads(first)
    assert (rec["lengths"], rec["depths"], rec["task"], rec["dtype"]) == ([300], [0.5], "passkey", "float32")
    passkey_grid.main([*base, "--lengths", "300"])  # the cell is there: nothing is added
    assert out.read_text() == first
    for flag, value in [("--lengths", "400"), ("--depths", "0.1"), ("--task", "multikey"), ("--dtype", "bfloat16")]:
        with pytest.raises(SystemExit) as err:
            passkey_grid.main([*base, "--lengths", "300", flag, value])
        assert str(err.value).startswith(f"{flag}: {out} holds a run with ") and "\n" not in str(err.value)
    cells.write_text(json.dumps([{"name": "full", "method": "scissorhands", "budget": 0.2}]))  # renamed in place
    with pytest.raises(SystemExit) as err:
        passkey_grid.main([*base, "--lengths", "300"])
    assert str(err.value).startswith("--cells: cell 'full' is in ")
    assert out.read_text() == first


def test_passkey_grid_resumes_a_cell_cut_off_at_its_first_unscored_prompt(tmp_path, monkeypatch):
    """A 16,384-token prompt takes minutes: the scored prompts of a cell cut off wait in ``<out>.partial/`` and
    a rerun scores only the rest, to the record an uninterrupted run writes."""
    from scissorhands.tools.eval.passkey import Passkey

    passkey_grid, model, cells, out = _passkey_grid_run(tmp_path, "pk.jsonl")
    base = ["--model", model, "--cells", str(cells), "--depths", "0.2,0.5,0.8", "--lengths", "300"]
    passkey_grid.main([*base, "--out", str(tmp_path / "whole.jsonl")])
    whole = json.loads((tmp_path / "whole.jsonl").read_text())
    real, calls = Passkey.score, []

    def score(self, model, item, setup):
        calls.append(item.key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, model, item, setup)

    with monkeypatch.context() as m:
        m.setattr(Passkey, "score", score)
        with pytest.raises(KeyboardInterrupt):
            passkey_grid.main([*base, "--out", str(out)])
    assert not out.exists() and len(next((tmp_path / "pk.jsonl.partial").iterdir()).read_text().splitlines()) == 1
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(Passkey, "score", lambda self, *a: calls.append(a[1].key) or real(self, *a))
        passkey_grid.main([*base, "--out", str(out)])
    assert calls == ["L300-d0.5-t0", "L300-d0.8-t0"]
    rec = json.loads(out.read_text())
    assert rec["item_scores"] == whole["item_scores"] and rec["metrics"] == whole["metrics"]
    assert not (tmp_path / "pk.jsonl.partial").exists()


def test_passkey_grid_trials_draw_more_prompts_and_keep_runs_apart(tmp_path):
    """--trials k scores k prompts per asked key, each with its own keys; a run of another trial count is refused."""
    passkey_grid, model, cells, out = _passkey_grid_run(tmp_path, "mk.jsonl")
    base = ["--model", model, "--cells", str(cells), "--task", "multikey", "--keys", "2", "--lengths", "600",
            "--out", str(out)]
    passkey_grid.main([*base, "--trials", "3"])
    rec = json.loads(out.read_text())
    assert rec["trials"] == 3 and len(rec["item_scores"]) == 2 * 3
    with pytest.raises(SystemExit) as err:
        passkey_grid.main([*base, "--trials", "2"])
    assert str(err.value).startswith("--trials: ") and "\n" not in str(err.value)
    # the prompts of one (length, asked key) differ from trial to trial
    from transformers import AutoTokenizer

    from scissorhands.tools.eval.passkey import MultiKey

    items = MultiKey(lengths=(600,), keys=2, trials=3).items(AutoTokenizer.from_pretrained(model), None)
    asked_first = [it.data["cont"] for it in items if "-k0-" in it.key]
    assert len(asked_first) == 3 and len({tuple(c) for c in asked_first}) == 3


def test_length_table_pairs_the_three_forms_and_refuses_a_cell_without_one(tmp_path, capsys):
    """The plain mean (rows without mean_cap are the plain mean), the sum (h2o) and the capped mean, each against
    the full cache window by window, and the capped mean against the better of the other two."""
    from scissorhands.core.settings.config import DEFAULTS

    length_table = script("length_table")
    d = {k: v for k, v in DEFAULTS.as_dict().items() if k != "mean_cap"}
    full, plain, summed, capped = [3.0, 3.2], [3.1, 3.4], [3.2, 3.25], [3.05, 3.35]
    rows = [("full", None, d, full), ("scissorhands", 0.2, d, plain), ("h2o", 0.2, {**d, "importance": "sum"}, summed),
            ("scissorhands", 0.2, {**d, "mean_cap": 2048}, capped),
            ("scissorhands", 0.2, {**d, "recent": 0.1, "mean_cap": 2048}, [9.0, 9.0])]  # another setting: left out
    (tmp_path / "cell").mkdir()
    (tmp_path / "cell" / "results.jsonl").write_text("".join(json.dumps(
        {"task": "ppl", "method": m, "budget": b, "metric": "ppl", "value": 20.0, "config": c,
         "item_scores": [{"nll": v} for v in vals], "metrics": {"n": len(vals), "ppl": 20.0}}) + "\n"
        for m, b, c, vals in rows))
    assert length_table.main([f"tiny={tmp_path / 'cell'}"]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("| tiny | 2 | +0.1500 ±") and "| **+0.1000 ±" in line
    assert line.endswith("(sum) |") and "| -0.0250 ±" in line  # capped - sum: (0.05 - 0.2 + 0.15 - 0.05) / 2
    with pytest.raises(SystemExit) as err:
        length_table.main([f"tiny={tmp_path / 'cell'}", "--budget", "0.1"])
    assert "lacks ['capped', 'mean', 'sum'] at budget 0.1" in str(err.value)


def test_peer_table_pairs_each_row_with_its_groups_full_cache(tmp_path, capsys):
    """Rows from two folders of one group (a peers run, a --preset paper run) are paired with the one full row."""
    from scissorhands.core.settings.config import DEFAULTS, PRESETS

    peer_table = script("peer_table")
    paper = {**DEFAULTS.as_dict(), **PRESETS["paper"]}
    full, ours, h2o, pap = [3.0, 3.2], [3.1, 3.3], [3.2, 3.3], [3.3, 3.5]

    def write(folder, rows):
        folder.mkdir()
        (folder / "results.jsonl").write_text("".join(json.dumps(
            {"task": "ppl", "method": m, "budget": b, "metric": "ppl", "value": 20.0, "config": c,
             "item_scores": [{"nll": v} for v in vals],
             "metrics": {"n": len(vals), "ppl": 20.0}}) + "\n" for m, b, c, vals in rows))

    d = DEFAULTS.as_dict()
    write(tmp_path / "peers", [("full", None, d, full), ("scissorhands", 0.2, d, ours), ("h2o", 0.2, d, h2o),
                               ("h2o", 0.1, d, h2o)])
    write(tmp_path / "paper", [("scissorhands", 0.2, paper, pap)])
    assert peer_table.main([f"tiny={tmp_path / 'peers'},{tmp_path / 'paper'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| model, text, T | windows | full-cache ppl | method | 5x | 10x |"
    assert lines[2].startswith("| tiny | 2 | 20.00 | defaults | **+0.1000 ±0.0000** | — |")
    assert lines[3] == "| | | | paper | +0.3000 ±0.0000 | — |"
    assert lines[4] == "| | | | h2o | +0.1500 ±0.0980 | **+0.1500 ±0.0980** |"
    assert peer_table.main([f"tiny={tmp_path / 'paper'}"]) == 2  # no full row in the group
    assert "no full-cache row" in capsys.readouterr().err


def test_scale_plot_pairs_two_models_on_the_same_windows(tmp_path, capsys):
    """``--same-windows A,B``: B's ΔNLL minus A's, window by window; unequal window counts are refused."""
    scale_plot = script("scale_plot")

    def write(name, full, five, ten):
        folder = tmp_path / name
        folder.mkdir()
        rows = [("full", None, full), ("scissorhands", 0.2, five), ("scissorhands", 0.1, ten)]
        (folder / "results.jsonl").write_text("".join(
            json.dumps({"task": "ppl", "method": m, "budget": b, "metric": "ppl", "value": 0.0,
                        "item_scores": [{"nll": v} for v in vals]}) + "\n" for m, b, vals in rows))
        return folder

    small = write("small", [3.0, 3.2, 3.1], [3.1, 3.4, 3.2], [3.3, 3.6, 3.4])  # ΔNLL 0.1, 0.2, 0.1 / 0.3, 0.4, 0.3
    large = write("large", [2.0, 2.2, 2.1], [2.05, 2.3, 2.1], [2.1, 2.4, 2.2])  # 0.05, 0.1, 0.0 / 0.1, 0.2, 0.1
    runs = [f"a:1e8:{small}", f"b:1e9:{large}"]
    assert scale_plot.main([*runs, "--out", str(tmp_path / "s.png"), "--same-windows", "a,b"]) == 0
    out = capsys.readouterr().out
    assert "b - a, 5x, paired over 3 windows: -0.0833 ±" in out
    assert "b - a, 10x, paired over 3 windows: -0.2000 ±0.0000" in out
    assert (tmp_path / "s.png").is_file()
    short = write("short", [2.0], [2.1], [2.2])
    with pytest.raises(SystemExit):
        scale_plot.main([f"a:1e8:{small}", f"c:1e9:{short}", "--out", str(tmp_path / "t.png"), "--same-windows", "a,c"])
    assert "same-windows: a has 3 windows and c 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scale_plot.main([*runs, "--out", str(tmp_path / "t.png"), "--same-windows", "a,z"])
    assert "same-windows:" in capsys.readouterr().err


def test_retrieval_probe_finds_protected_keys_in_every_head_and_refuses_bad_flags(tmp_path, capsys):
    """Protected facts are held whole in every layer and KV head of an evicting cache, before the answer and after
    it; the full cache answers as generate() does; a bad --cell, --settings or --items is one line naming the
    flag."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scissorhands.tools.eval.passkey import MultiKey

    _, model, cells, _ = _passkey_grid_run(tmp_path, "unused")
    cells.write_text(json.dumps([
        {"name": "full", "method": "full", "budget": None},
        {"name": "protected", "method": "scissorhands", "budget": 0.2, "protect_facts": True}]))
    probe = script("retrieval_probe")
    base = ["--model", model, "--cells", str(cells), "--task", "multikey", "--keys", "2", "--lengths", "600"]
    assert probe.main([*base, "--cell", "protected"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["item"] for r in recs] == ["L600-k0-t0", "L600-k1-t0"]
    for r in recs:
        assert len(r["facts"]) == 2 and sum(f["asked"] for f in r["facts"]) == 1
        assert all(f["kept"] == 1.0 and f["whole"] == 1.0 and f["key"].isdigit() for f in r["facts"])
        assert all(f["whole_after"] == 1.0 for f in r["facts"])  # and still whole once the answer is written
    assert probe.main([*base, "--cell", "full", "--items", "L600-k1-t0"]) == 0
    (rec,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tok, lm = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model)
    item = MultiKey(lengths=(600,), keys=2).items(tok, None)[1]
    ids = torch.tensor([item.data["ctx"]])
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=len(item.data["cont"]) + 2, pad_token_id=0)
    assert rec["answer"] == tok.decode(out[0, ids.shape[1]:])
    for flag, value in [("--cell", "nope"), ("--settings", "[1]"), ("--settings", "{\"pool\": 4}"),
                        ("--items", "L600-k9-t0")]:
        args = [*base, "--cell", "full", flag, value] if flag != "--cell" else [*base, flag, value]
        with pytest.raises(SystemExit) as err:
            probe.main(args)
        assert str(err.value).startswith(f"{flag}: ") and "\n" not in str(err.value)


def test_engine_agreement_matches_rows_by_settings_and_counts_same_answers(tmp_path, capsys):
    """Rows of the same method, budget and settings are compared over the problems both answered; a row whose
    settings differ is not matched, and no match at all is exit code 1."""
    agreement = script("engine_agreement")
    config = {"rounds": True, "prefill": "stream"}

    def row(method, budget, answers, engine=None, settings=config):
        key = {"method": method, "budget": budget, **({"engine": engine} if engine else {})}
        return {"task": "humaneval-chat", "method": method, "budget": budget, "metric": "pass@1", "value": 0.0,
                "config": settings, "key": key,
                "item_scores": [{"completion": c, "passed": float(p)} for c, p in answers]}

    first, second = tmp_path / "hf", tmp_path / "vllm"
    first.mkdir()
    second.mkdir()
    (first / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        row("scissorhands", 190, [("a", 1), ("b", 0), ("c", 1)]),
        row("h2o", 190, [("a", 1)], settings={"rounds": False})]))
    (second / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        row("scissorhands", 190, [("a", 1), ("x", 1), ("c", 1), ("d", 0)], engine="vllm"),
        row("h2o", 190, [("a", 1)], engine="vllm")]))
    assert agreement.main([str(first), str(second), "--task", "humaneval-chat"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert lines == ["| scissorhands | 190 | 3 | 2 (67%) | 2 (67%) | 2 | 3 |"], lines
    assert agreement.main([str(first), str(second), "--task", "mbpp"]) == 1
