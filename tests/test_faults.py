"""Faults and misuse: interrupted and changed eval grids, damaged files, read-only folders, a corrupted
model cache, a cache used with the wrong model or for a second prompt, and inputs at the edges."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache

import scissorhands
from conftest import (
    ByteTokenizer,
    left_padded,
    run_cli,
    save_tiny_model,
    sigint_as_in_a_terminal,
    tiny_config,
    tiny_model,
)
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.core.settings.schedule import load_schedule
from scissorhands.tools import model_cache
from scissorhands.tools import models as models_module
from scissorhands.tools.cli import memory_line
from scissorhands.tools.eval import run_grid
from scissorhands.tools.eval.records import RESULTS_FILE, load_results
from scissorhands.tools.eval.tasks import Perplexity, read_requests
from scissorhands.tools.generation import demo_prompt, generate
from scissorhands.tools.text import decode_text

BASE = ScissorhandsConfig(budget=16, recent=4, drop=0.4, window=16).settings
SRC = str(Path(scissorhands.__file__).resolve().parents[1])


cli = run_cli


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "hamlet.txt"
    path.write_text(demo_prompt())
    return path


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny")


# ---------------------------------------------------------------------------------------------
# the eval grid: resume keyed by everything, interrupted runs, torn and foreign files
# ---------------------------------------------------------------------------------------------


def interrupt_after(monkeypatch, n: int) -> None:
    """Make Perplexity raise KeyboardInterrupt when it is about to score its (n+1)-th item."""
    real, count = Perplexity.score, [0]

    def score(self, model, item, setup):
        if count[0] == n:
            raise KeyboardInterrupt
        count[0] += 1
        return real(self, model, item, setup)

    monkeypatch.setattr(Perplexity, "score", score)


def grid(out, text_file, seq_len=48, base=BASE, model=None, task=None, budgets=(0.25, 0.5), limit=None, seed=0):
    task = task or Perplexity(seq_len=seq_len, n_windows=1, data=str(text_file))
    methods = [get_method(m) for m in ("full", "scissorhands")]
    return run_grid(model or tiny_model("llama"), ByteTokenizer(), model_name="tiny-llama", tasks=[task],
                    methods=methods, budgets=list(budgets), base=base, out_dir=out, limit=limit, seed=seed)


def rows(out):
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def test_interrupted_grid_resumes_then_changed_settings_never_reuse(tmp_path, text_file, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        interrupt_after(m, 2)  # two cells of one window each are written, the third is cut
        grid(out, text_file)
    assert [(r["method"], r["budget"]) for r in rows(out)] == [("full", None), ("scissorhands", 0.25)]
    first = rows(out)

    resumed = grid(out, text_file)
    assert [r["wall_s"] for r in resumed[:2]] == [r["wall_s"] for r in first]  # reused, not recomputed
    assert len(rows(out)) == 3

    changes = {
        "seq-len": dict(seq_len=40),
        "recent": dict(base=ScissorhandsConfig(budget=16, recent=2, drop=0.4, window=16).settings),
        "window": dict(base=ScissorhandsConfig(budget=16, recent=4, drop=0.4, window=8).settings),
        "limit": dict(limit=1),
        "seed": dict(seed=1),
        "dtype": dict(model=tiny_model("llama", torch.bfloat16)),
        "weights": dict(model=tiny_model("qwen2")),
    }
    changes["kv-bits"] = dict(base=dataclasses.replace(BASE, kv_bits=8))
    count = 3
    for name, change in changes.items():
        results = grid(out, text_file, **change)
        written = rows(out)
        # An eviction setting leaves the exact full cache as it is: its row is reused, and only then.
        shared = 1 if name in ("recent", "window") else 0
        assert len(written) == count + len(results) - shared, name  # new rows beside the old
        old_ids = {r["key_id"] for r in written[:count]}
        assert [r["key_id"] in old_ids for r in results] == [bool(shared)] + [False] * (len(results) - 1), name
        count = len(written)
    # the first setting is still there, and still reused
    again = grid(out, text_file)
    assert [r["wall_s"] for r in again] == [r["wall_s"] for r in resumed] and len(rows(out)) == count


def counted_scores(monkeypatch) -> list:
    """Count the items Perplexity scores."""
    real, calls = Perplexity.score, []

    def score(self, model, item, setup):
        calls.append(item.key)
        return real(self, model, item, setup)

    monkeypatch.setattr(Perplexity, "score", score)
    return calls


def test_a_cell_cut_off_midway_resumes_at_its_first_unscored_item(tmp_path, text_file, monkeypatch):
    """Each scored item waits in ``partial/<key_id>.jsonl`` until its cell's record is written: a resumed grid
    scores only the items not yet there, and its records equal an uninterrupted run's. A torn last line is
    scored again; ``resume=False`` starts afresh; a finished grid leaves no partial file."""
    task = Perplexity(seq_len=48, n_windows=4, data=str(text_file))
    whole = grid(tmp_path / "whole", text_file, task=task)
    assert len(whole[0]["item_scores"]) == 4

    def settled(records):
        return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]

    out = tmp_path / "out"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        interrupt_after(m, 6)  # the full cell (4 items) is written, the first budget's cell is cut after 2
        grid(out, text_file, task=task)
    assert [r["method"] for r in rows(out)] == ["full"]
    (waiting,) = (out / "partial").iterdir()
    assert waiting.name == f"{whole[1]['key_id']}.jsonl" and len(waiting.read_text().splitlines()) == 2
    with monkeypatch.context() as m:
        calls = counted_scores(m)
        resumed = grid(out, text_file, task=task)
    assert len(calls) == 2 + 4  # the cut cell's last two items, then the second budget's four
    assert settled(resumed) == settled(whole)
    assert not (out / "partial").exists()

    # a torn last line: that item is scored again
    out2 = tmp_path / "torn"
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        interrupt_after(m, 7)
        grid(out2, text_file, task=task)
    (waiting,) = (out2 / "partial").iterdir()
    text = waiting.read_text()
    waiting.write_text(text[: len(text) - 20])
    with monkeypatch.context() as m:
        calls = counted_scores(m)
        assert settled(grid(out2, text_file, task=task)) == settled(whole)
    assert len(calls) == 2 + 4

    # resume=False scores every item again
    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        interrupt_after(m, 2)  # the full cell is reused: the new budget's cell is cut after 2
        grid(out2, text_file, task=task, budgets=(0.3,))
    (waiting,) = (out2 / "partial").iterdir()
    assert len(waiting.read_text().splitlines()) == 2
    with monkeypatch.context() as m:
        calls = counted_scores(m)
        methods = [get_method(x) for x in ("full", "scissorhands")]
        run_grid(tiny_model("llama"), ByteTokenizer(), model_name="tiny-llama", tasks=[task], methods=methods,
                 budgets=[0.3], base=BASE, out_dir=out2, resume=False)
    assert len(calls) == 4 + 4 and not (out2 / "partial").exists()


def test_a_record_from_before_a_setting_existed_is_reused_at_its_default(tmp_path, text_file):
    """Rows written before ``decode`` existed resume a grid at the default ``decode``, not at another value.

    The old rows are made as a version without the setting wrote them: the setting deleted from each key
    (and its digest recomputed), and the full row keyed by every setting, as before it was keyed by none.
    """
    from scissorhands.tools.eval.records import key_id

    out = tmp_path / "out"
    first = grid(out, text_file)
    old = []
    for r in rows(out):
        if r["method"] == "full":
            assert r["key"]["settings"] == {}  # an exact full cache is keyed by no setting
            r["key"]["settings"] = dict(r["config"])
        del r["key"]["settings"]["decode"]
        old.append({**r, "key_id": key_id(r["key"])})
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    again = grid(out, text_file)
    assert [r["wall_s"] for r in again] == [r["wall_s"] for r in first]  # reused, not recomputed
    assert len(rows(out)) == len(old)
    grid(out, text_file, base=dataclasses.replace(BASE, decode="static"))  # the full row is shared, the rest new
    assert [r["key"]["settings"]["decode"] for r in rows(out)[len(old):]] == ["static", "static"]
    renamed = [{**r, "key": {**r["key"], "version": "0.0.1"}} for r in old]  # another version: never reused
    (out / RESULTS_FILE).write_text("".join(json.dumps({**r, "key_id": key_id(r["key"])}) + "\n" for r in renamed))
    grid(out, text_file)
    assert len(rows(out)) == 2 * len(old)


def test_a_record_from_before_mean_cap_is_reused_as_the_plain_mean_only(tmp_path, text_file):
    """``mean_cap`` came with a default (2048) that changes what a long cell computes, so a row written before it
    existed is the plain mean (``mean_cap=None``): reused at None, scored again at the default."""
    from scissorhands.tools.eval.records import key_id

    out = tmp_path / "out"
    grid(out, text_file)
    old = []
    for r in rows(out):
        if r["method"] != "full":
            del r["key"]["settings"]["mean_cap"]
        old.append({**r, "key_id": key_id(r["key"])})
    (out / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    grid(out, text_file, base=dataclasses.replace(BASE, mean_cap=None))
    assert len(rows(out)) == len(old)  # reused
    grid(out, text_file)  # the default cap: the budgeted row is new, the full row shared
    new = rows(out)[len(old):]
    assert [(r["method"], r["key"]["settings"]["mean_cap"]) for r in new] == [("scissorhands", 2048)] * 2


def test_a_changed_data_file_is_not_reused(tmp_path, text_file):
    out = tmp_path / "out"
    first = grid(out, text_file)
    text_file.write_text(demo_prompt()[::-1])
    second = grid(out, text_file)
    assert {r["key_id"] for r in first}.isdisjoint({r["key_id"] for r in second})


def test_cli_summary_leaves_out_rows_measured_another_way(tmp_path, tiny_folder, text_file, capsys):
    out = tmp_path / "out"
    common = ["eval", "--model", str(tiny_folder), "--text", str(text_file), "--methods", "full,scissorhands",
              "--budgets", "0.5", "--num-samples", "1", "--out", str(out), "--recent", "4"]
    assert cli(capsys, *common, "--seq-len", "64")[0] == 0
    code, stdout, _ = cli(capsys, *common, "--seq-len", "96")
    assert code == 0
    records = load_results(out / RESULTS_FILE)
    assert len(records) == 4 and sorted({r["mean_length"] for r in records}) == [64, 96]
    summary = (out / "summary.md").read_text()
    new = [r for r in records if r["mean_length"] == 96]
    assert all(f"{r['compression']:.1f}x" in summary for r in new)
    table = summary.split("## Every result\n\n")[1]
    assert sum(line.startswith("|") for line in table.splitlines()) == 4  # header, rule, full, scissorhands:
    # the old run's rows are not in it
    paired = summary.split("## Every result")[0]
    assert sum(line.startswith("| scissorhands |") for line in paired.splitlines()) == 1


def test_cli_summary_shows_earlier_runs_on_the_same_windows_each_row_named(tmp_path, tiny_folder, text_file,
                                                                            capsys):
    """Two settings of one method into one folder: summary.md shows both rows, named by the setting that
    differs, and the full cache (keyed by no setting) once; before, the second run's summary hid the first."""
    out = tmp_path / "out"
    common = ["eval", "--model", str(tiny_folder), "--text", str(text_file), "--methods", "full,scissorhands",
              "--budgets", "0.5", "--num-samples", "2", "--seq-len", "64", "--out", str(out)]
    assert cli(capsys, *common, "--recent", "4")[0] == 0
    code, _, err = cli(capsys, *common, "--recent", "8")
    assert code == 0 and "also shows 1 row of earlier runs" in err
    records = load_results(out / RESULTS_FILE)
    assert [r["method"] for r in records] == ["full", "scissorhands", "scissorhands"]
    summary = (out / "summary.md").read_text()
    paired, table = summary.split("## Every result")
    for recent, rec in zip((4, 8), records[1:]):
        nll = [s["nll"] for s in rec["item_scores"]]
        base = [s["nll"] for s in records[0]["item_scores"]]
        delta = sum(a - b for a, b in zip(nll, base)) / len(nll)
        assert f"| scissorhands (recent={recent}) | 0.5 | {delta:+.4f}" in paired
        assert f"| scissorhands (recent={recent}) | 0.5 |" in table
    assert sum(line.startswith("| full |") for line in table.splitlines()) == 1


def test_row_labels_name_what_sets_rows_apart():
    from scissorhands.tools.eval.report import row_labels

    def rec(method, **settings):
        return {"method": method, "key": {"method": method, "settings": settings}}

    exact = rec("full")
    packed = rec("full", **{**BASE.as_dict(), "kv_bits": 4})
    a = rec("scissorhands", **{**BASE.as_dict(), "prefill": "stream"})
    b = rec("scissorhands", **{**BASE.as_dict(), "prefill": "prompt-aware"})
    assert row_labels([exact, a]) == ["full", "scissorhands"]  # one setting each: plain names
    labels = row_labels([exact, packed, a, b])
    assert labels[0] == "full" and "kv_bits=4" in labels[1] and "prefill" not in labels[1]
    assert labels[2:] == ["scissorhands (prefill=stream)", "scissorhands (prefill=prompt-aware)"]


def test_summary_rows_sit_beside_their_method_whatever_order_runs_wrote_them():
    """A later run's 2x rows are listed with their method, before its 5x rows, and the full cache first."""
    from scissorhands.tools.eval.report import summary_table
    from scissorhands.tools.eval.tasks import Perplexity

    def rec(method, budget, compression):
        return {"task": "ppl", "method": method, "budget": budget, "compression": compression,
                "metrics": Perplexity().aggregate([{"nll": 3.0}, {"nll": 3.1}]), "item_scores": []}

    written = [rec("scissorhands", 0.2, 5.0), rec("full", None, 1.0), rec("h2o", 0.2, 5.0),
               rec("h2o", 0.5, 2.0), rec("scissorhands", 0.5, 2.0)]
    rows = [line.split("|")[1:3] for line in summary_table(written).splitlines()[2:]]
    assert [(m.strip(), b.strip()) for m, b in rows] == [("full", "full"), ("scissorhands", "0.5"),
                                                         ("scissorhands", "0.2"), ("h2o", "0.5"), ("h2o", "0.2")]


@pytest.mark.parametrize("task, option, length", [("ppl", "num-samples", 512), ("agreement", "limit", 512)])
def test_asking_for_more_windows_than_the_text_holds_is_refused(tmp_path, tiny_folder, text_file, capsys, task,
                                                                option, length):
    """Never fewer windows than asked without a word: one line naming the option, and nothing written.

    Perplexity's windows are --seq-len tokens, counted by --num-samples; agreement's prompts are 512 tokens,
    counted by --limit.
    """
    from scissorhands.tools.text import corpus_tokens, load_texts

    holds = len(corpus_tokens(ByteTokenizer(), load_texts(str(text_file)))) // length
    out = tmp_path / "out"
    common = ["eval", "--model", str(tiny_folder), "--text", str(text_file), "--tasks", task, "--methods", "full",
              "--seq-len", str(length), "--out", str(out)]
    code, _, err = cli(capsys, *common, f"--{option}", str(holds + 1))
    assert code == 2 and one_line(err).startswith(f"scissorhands: error: {option}: the text holds {holds} windows")
    assert not (out / RESULTS_FILE).exists()
    assert cli(capsys, *common, f"--{option}", str(holds))[0] == 0  # every window it holds is fine
    assert load_results(out / RESULTS_FILE)[0]["n_items"] == holds


def test_torn_last_line_is_reported_dropped_and_the_run_goes_on(tmp_path, text_file, caplog):
    out = tmp_path / "out"
    first = grid(out, text_file)
    path = out / RESULTS_FILE
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"task": "ppl", "method": "scissorhands", "bud')  # killed mid-write
    assert len(load_results(path)) == 3  # readers skip it
    with caplog.at_level(logging.WARNING, logger="scissorhands.tools.eval.runner"):
        again = grid(out, text_file)
    message = next(r.getMessage() for r in caplog.records if "incomplete" in r.getMessage())
    assert str(path) in message and "line 4" in message
    assert path.read_bytes() == whole  # the torn line is gone, nothing else touched
    assert [r["wall_s"] for r in again] == [r["wall_s"] for r in first]


def test_a_damaged_middle_line_or_foreign_file_is_refused_untouched(tmp_path, text_file):
    out = tmp_path / "out"
    grid(out, text_file)
    path = out / RESULTS_FILE
    lines = path.read_text().splitlines(keepends=True)
    damaged = lines[0] + "{oops\n" + "".join(lines[1:])
    path.write_text(damaged)
    with pytest.raises(ValueError, match=r"^out: .*line 2 is not JSON"):
        grid(out, text_file)
    assert path.read_text() == damaged
    path.write_text('{"unrelated": true}\n')
    with pytest.raises(ValueError, match=r"^out: .*line 1 is not a scissorhands result"):
        grid(out, text_file)
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(ValueError, match="^out: .*not UTF-8"):
        grid(out, text_file)


def test_numpy_budgets_and_settings_are_accepted_and_recorded(tmp_path, text_file):
    base = ScissorhandsConfig(budget=16, recent=np.int64(4), drop=np.int64(2), window=np.int32(16)).settings
    results = grid(tmp_path / "out", text_file, base=base, budgets=(np.float64(0.5), np.int64(40)))
    assert [r["budget"] for r in rows(tmp_path / "out")] == [None, 0.5, 40]
    assert results[2]["config"]["recent"] == 4
    assert ScissorhandsConfig(budget=np.int64(40)).budget == 40


# ---------------------------------------------------------------------------------------------
# output folders: checked before the model loads; OSError and Ctrl-C at the command-line boundary
# ---------------------------------------------------------------------------------------------


def _writes_are_refused(folder: Path) -> bool:
    try:
        (folder / "probe").write_text("x")
    except OSError:
        return True
    (folder / "probe").unlink()
    return False


@pytest.mark.parametrize("command", ["eval", "analyze", "generate --audit"])
def test_read_only_output_folder(tmp_path, capsys, monkeypatch, command, text_file):
    """A read-only --out fails before the model loads, naming ``out`` and the folder.

    Permission bits do not stop a privileged user; there the same refusal is
    produced by the filesystem call itself failing (as on a read-only mount).
    """
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if not _writes_are_refused(folder):  # privileged: permission bits are ignored
            import tempfile

            def refuse(*args, **kwargs):
                raise PermissionError(13, "Permission denied", str(kwargs.get("dir", "")))

            monkeypatch.setattr(tempfile, "mkstemp", refuse)
        loads = []
        monkeypatch.setattr(models_module, "load_model", lambda *a, **k: loads.append(a))
        if command == "generate --audit":
            option = "audit"
            code, _, err = cli(capsys, "generate", "--model", "x", "--budget", "40", "--prompt", "hi", "--audit",
                               str(folder / "audit.json"))
        else:
            option = "out"
            code, _, err = cli(capsys, command, "--model", "x", "--out", str(folder / "sub"), "--text",
                               str(text_file))
    finally:
        folder.chmod(0o755)
    line = one_line(err)
    assert code == 2 and line.startswith(f"scissorhands: error: {option}: cannot write in") and str(folder) in line
    assert loads == [] and list(folder.iterdir()) == []


def test_oserror_while_working_is_one_line_naming_the_option_and_path(tmp_path, capsys, monkeypatch, text_file):
    import scissorhands.tools.eval as eval_pkg

    out = tmp_path / "out"

    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(out / RESULTS_FILE))

    monkeypatch.setattr(models_module, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(eval_pkg, "run_grid", fail)
    code, _, err = cli(capsys, "eval", "--text", str(text_file), "--out", str(out))
    assert code == 2
    assert one_line(err) == f"scissorhands: error: out: Permission denied: {str(out / RESULTS_FILE)!r}"


def test_ctrl_c_is_one_line_and_exit_code_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models_module, "load_model", interrupted)
    code, _, err = cli(capsys, "generate", "--budget", "40", "--prompt", "hello")
    assert code == 130 and one_line(err) == "scissorhands: interrupted"


def _signal_once_loaded(command: list[str], sig: int, env: dict) -> tuple[int, str, str]:
    """Run ``command``, send ``sig`` once its model is loaded (it is then inside main), and return its exit
    code, the stderr before the signal and the stderr after it."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            preexec_fn=sigint_as_in_a_terminal)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "scissorhands.tools.models: loaded" in line:
                break
        proc.send_signal(sig)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, "".join(seen), rest


def test_ctrl_c_in_a_real_process(tmp_path, tiny_folder, text_file):
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")
    code, seen, rest = _signal_once_loaded(
        [sys.executable, "-m", "scissorhands.tools.cli", "-v", "eval", "--model", str(tiny_folder), "--text",
         str(text_file), "--seq-len", "32", "--num-samples", "64", "--out", str(tmp_path / "out")], signal.SIGINT, env)
    assert code == 130, seen + rest
    assert "Traceback" not in rest and rest.strip().splitlines()[-1] == "scissorhands: interrupted"


def test_sigterm_ends_an_eval_in_one_line_that_says_it_resumes(tmp_path, tiny_folder, text_file):
    """SIGTERM (a scheduler, ``kill``) ends a run as Ctrl-C does: exit 143, no traceback, one line saying
    where the finished rows are; the same command then resumes from them and finishes the grid."""
    env = dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "scissorhands.tools.cli", "-v", "eval", "--model", str(tiny_folder), "--text",
               str(text_file), "--seq-len", "32", "--num-samples", "64", "--methods", "full,scissorhands",
               "--budgets", "0.5,0.3", "--out", str(out)]
    code, seen, rest = _signal_once_loaded(command, signal.SIGTERM, env)
    assert code == 143, seen + rest
    assert "Traceback" not in rest
    assert rest.strip().splitlines()[-1] == (f"scissorhands: terminated; the rows finished are in {out} (a row cut "
                                             "off keeps its scored items), and the same command resumes from them")
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["method"], str(r["budget"])) for r in rows) == [
        ("full", "None"), ("scissorhands", "0.3"), ("scissorhands", "0.5")]


def test_version(capsys):
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"scissorhands {scissorhands.__version__}"


# ---------------------------------------------------------------------------------------------
# the model cache verifies itself
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_folder):
    """A GGUF 'conversion' that loads the tiny model and counts how often it runs."""
    from transformers import AutoTokenizer

    calls = []

    def convert(folder, filename):
        calls.append(filename)
        return AutoModelForCausalLM.from_pretrained(tiny_folder), AutoTokenizer.from_pretrained(tiny_folder)

    monkeypatch.setattr(model_cache, "_convert_gguf", convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf, tmp_path / "cache" / "m", calls


def test_model_cache_is_verified_and_repaired(fake_gguf, caplog):
    gguf, folder, calls = fake_gguf

    def load():
        with caplog.at_level(logging.WARNING, logger="scissorhands.tools.model_cache"):
            caplog.clear()
            model_cache.load_converted(str(gguf), folder, "m")
        return [r.getMessage() for r in caplog.records]

    assert load() == [] and len(calls) == 1
    manifest = json.loads((folder / model_cache.MANIFEST).read_text())
    assert set(manifest["files"]) >= {"config.json", "model.safetensors"}
    assert load() == [] and len(calls) == 1  # verified, not converted again

    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(64)  # corruption that keeps the size
    weights.write_bytes(bytes(data))
    messages = load()
    assert len(calls) == 2 and len(messages) == 1
    assert "different checksum" in messages[0] and "converting again" in messages[0] and "\n" not in messages[0]
    assert load() == [] and len(calls) == 2  # repaired

    weights.unlink()  # an incomplete folder
    messages = load()
    assert len(calls) == 3 and "lacks model.safetensors" in messages[0]
    assert load() == [] and len(calls) == 3

    with weights.open("ab") as f:  # a file of another size
        f.write(b"x")
    assert "bytes" in load()[0] and len(calls) == 4

    (folder / model_cache.MANIFEST).unlink()  # a folder from an older version: not trusted
    assert "manifest" in load()[0] and len(calls) == 5
    assert load() == [] and len(calls) == 5


def test_unchanged_cache_is_not_rehashed(fake_gguf, monkeypatch):
    gguf, folder, calls = fake_gguf
    model_cache.load_converted(str(gguf), folder, "m")
    hashed = []
    real = model_cache._sha256
    monkeypatch.setattr(model_cache, "_sha256", lambda p: hashed.append(p) or real(p))
    assert model_cache._cache_problem(folder) is None and hashed == []
    os.utime(folder / "model.safetensors")  # touched, same content: hashed once, still fine
    assert model_cache._cache_problem(folder) is None and [p.name for p in hashed] == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# the cache knows its model, and a used cache is not silently reused
# ---------------------------------------------------------------------------------------------


def _generate(model, cache, ids, mask, n=4):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n, do_sample=False,
                              pad_token_id=0)


def _four_layer_llama():
    config = tiny_config("llama")
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("built_for,used_with", [("gemma3", "llama"), ("llama", "gemma3"), ("llama", "llama4"),
                                                 ("llama4", "llama"), ("llama", "qwen2")])
def test_a_cache_used_with_another_model_is_a_one_line_error(built_for, used_with):
    models = {"llama4": _four_layer_llama}
    build = models.get(built_for, lambda: tiny_model(built_for))()
    use = models.get(used_with, lambda: tiny_model(used_with))()
    scissorhands.enable(use)
    cache = ScissorhandsCache(build, ScissorhandsConfig(budget=12, recent=2))
    ids, mask = left_padded([20], seed=3)
    with pytest.raises(ValueError) as info:
        _generate(use, cache, ids, mask)
    assert str(info.value).startswith("model: this ScissorhandsCache was built for") and "\n" not in str(info.value)


def test_a_schedule_for_another_layer_count_is_refused():
    with pytest.raises(ValueError, match="^schedule: 30 budgets given for 2 full-attention layers"):
        ScissorhandsCache(tiny_model("llama"), ScissorhandsConfig(budget=40, schedule=(40,) * 30))


def test_bad_constructor_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="^config: must be a ScissorhandsConfig, got NoneType"):
        ScissorhandsCache(tiny_model("llama"), None)
    with pytest.raises(ValueError, match="^model: must be a transformers model or its config"):
        ScissorhandsCache("llama", ScissorhandsConfig(budget=40))


def test_a_second_independent_prompt_on_a_used_cache_is_refused():
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2))
    ids, mask = left_padded([20], seed=1)
    _generate(model, cache, ids, mask)
    for length in (20, 8):  # fed whole at positions the cache holds, or not at all
        other, other_mask = left_padded([length], seed=length)
        with pytest.raises(ValueError, match=r"^cache: this ScissorhandsCache has already seen 23 tokens"):
            _generate(model, cache, other, other_mask)
    cache.reset()  # then it is a fresh cache
    other, other_mask = left_padded([20], seed=20)
    fresh = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2))
    assert torch.equal(_generate(model, cache, other, other_mask), _generate(model, fresh, other, other_mask))


def test_continuing_a_conversation_on_purpose_works():
    """The whole conversation so far plus new tokens continues the cache, exactly as the full cache does."""
    model = tiny_model("llama")
    ids, mask = left_padded([20], seed=5)
    ours, full = ScissorhandsCache(model, ScissorhandsConfig(budget=64, recent=2)), DynamicCache(config=model.config)
    first = _generate(model, ours, ids, mask)
    assert torch.equal(first, _generate(model, full, ids, mask))
    turn = torch.cat([first, torch.tensor([[7, 8, 9]])], dim=1)
    second = _generate(model, ours, turn, torch.ones_like(turn))
    assert torch.equal(second, _generate(model, full, turn, torch.ones_like(turn)))
    assert ours.get_seq_length() == second.shape[1] - 1


# ---------------------------------------------------------------------------------------------
# inputs at the edges
# ---------------------------------------------------------------------------------------------


def test_prompt_past_the_models_positions_is_refused():
    model, tok = tiny_model("llama"), _HFByteTokenizer()
    config = ScissorhandsConfig(budget=40)
    with pytest.raises(ValueError, match="^max-new-tokens: 10 prompt tokens \\+ 1015 new tokens exceed"):
        generate(model, tok, "0123456789", config, max_new_tokens=1015)
    with pytest.raises(ValueError, match="^prompt: 1024 tokens, but the model has 1024 positions"):
        generate(model, tok, "x" * 1024, config, max_new_tokens=1)


class _HFByteTokenizer:
    """Just enough of a Hugging Face tokenizer for ``generate``: bytes in, ids out, left padding."""

    pad_token_id = 0
    padding_side = "left"

    def __call__(self, texts, return_tensors="pt", padding=True):
        from transformers import BatchEncoding

        ids = [[3 + b % 250 for b in t.encode()] for t in texts]
        width = max(len(i) for i in ids)
        return BatchEncoding({"input_ids": torch.tensor([[0] * (width - len(i)) + i for i in ids]),
                              "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])})

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["" for _ in ids]


def test_memory_line_when_the_sequence_fits_the_budget():
    model, tok = tiny_model("llama"), _HFByteTokenizer()
    short = generate(model, tok, "a short prompt", ScissorhandsConfig(budget=200), max_new_tokens=3)
    line = memory_line(short.memory)
    assert "no saving" in line and "nothing was evicted" in line and "x smaller" not in line
    long = generate(model, tok, "a longer prompt " * 20, ScissorhandsConfig(budget=40), max_new_tokens=3)
    line = memory_line(long.memory)
    ratio = float(line.split("x smaller")[0].rsplit(" ", 1)[-1])
    assert ratio > 1 and "no saving" not in line


def test_text_decoding_fallback_and_threshold(caplog):
    latin = "Voilà, garçon: ½ pièce à l'œil".replace("œ", "oe").encode("latin-1") * 5
    with caplog.at_level(logging.WARNING, logger="scissorhands.tools.text"):
        assert decode_text(latin, "data", "f.txt") == latin.decode("latin-1")
    assert any("read as Latin-1" in r.getMessage() for r in caplog.records)
    utf8 = "naïve café ".encode() * 30 + b"\xff"  # one stray byte in UTF-8 text: replaced, warned
    assert decode_text(utf8, "data", "f.txt").endswith("\ufffd")
    assert decode_text("\ufeffplain".encode(), "data", "f.txt") == "plain"
    with pytest.raises(ValueError, match=r"^prompt-file: 'f' is not a text file \(it holds NUL bytes\)"):
        decode_text(b"text\0more", "prompt-file", "f")
    noise = bytes(range(1, 32)) * 20 + b"words " * 10
    with pytest.raises(ValueError, match=r"^data: 'f' is not a text file .*control characters.* at most 1%"):
        decode_text(noise, "data", "f")


@pytest.mark.parametrize("content,match", [
    (bytes(range(128, 256)), "not UTF-8"),
    (json.dumps({"budgets": [True, 40]}).encode(), "positive integer"),
    (json.dumps({"budgets": []}).encode(), "positive integer"),
    (json.dumps([40, -1]).encode(), "positive integer"),
    (b"{", "not valid JSON"),
])
def test_bad_schedule_files(tmp_path, content, match):
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"^schedule: .*{match}"):
        load_schedule(path)


@pytest.mark.parametrize("lines,match", [
    ([{"context": "c", "choices": ["a", "b"]}], "line 1 has no 'label'"),
    ([{"context": "c", "choices": ["a", "b"], "label": 0}, {"context": "c", "choices": ["a"], "label": 1}],
     "line 2: 'label' must be a choice index in 0..0, got 1"),
    ([{"context": "c", "choices": ["a", "b"], "label": "0"}], "line 1: 'label' must be a choice index"),
    ([{"context": "c", "choices": [], "label": 0}], "line 1: 'choices' must be a non-empty list"),
    ([{"context": 3, "choices": ["a"], "label": 0}], "line 1: 'context' must be a string"),
    ([{"request": {"context": "c"}, "doc_id": 0, "idx": 0}], "line 1 lacks 'continuation'"),
])
def test_task_files_are_validated_line_by_line(tmp_path, lines, match):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=f"^tasks: .*{match}"):
        read_requests(path)


def test_lm_eval_backend_reports_a_bad_argument_in_one_line(capsys):
    pytest.importorskip("lm_eval")
    from scissorhands.tools.lm_eval_args import check_positive_int
    from scissorhands.tools.lm_eval_backend import main as lm_main

    assert check_positive_int("max_gen_toks", np.int64(3)) == 3
    with pytest.raises(SystemExit) as info:
        lm_main(["--model", "scissorhands", "--model_args", "method=magic,budget=0.2", "--tasks", "hellaswag"])
    assert info.value.code == 2
    err = capsys.readouterr().err  # lm-eval's own log lines come first; ours is one line, and no traceback
    ours = [line for line in err.splitlines() if line.startswith("scissorhands")]
    assert "Traceback" not in err and len(ours) == 1
    assert ours[0].startswith("scissorhands: error: method: unknown method 'magic'")


def test_results_are_keyed_by_file_contents_not_paths(tmp_path):
    """Editing a schedule or data file changes the key, and restoring it restores the key (the old rule,
    size and modification time, reused a stale row after an edit that kept the size)."""
    from scissorhands.tools.eval.records import key_id, run_key, task_identity

    model_id = {"name": "m"}
    method = get_method("scissorhands")

    def key(data, schedule):
        task = Perplexity(seq_len=32, n_windows=1, data=str(data))
        base = ScissorhandsConfig(budget=16, recent=4, schedule=str(schedule)).settings
        return key_id(run_key(model_id, task_identity(task), method, 0.5, base, None, 0))

    text, sched = tmp_path / "a.txt", tmp_path / "s.json"
    text.write_text("some text " * 50)
    sched.write_text(json.dumps({"budgets": [20, 20]}))
    first = key(text, sched)
    assert key(text, sched) == first
    sched.write_text(json.dumps({"budgets": [24, 16]}))
    assert key(text, sched) != first
    sched.write_text(json.dumps({"budgets": [20, 20]}))
    assert key(text, sched) == first
    text.write_text("other text " * 50)
    assert key(text, sched) != first


NAMES = ["a.json", "b.txt", "sub/a.json", "sub/../a.json", "./b.txt", "c.png"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(outputs=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3),
       inputs=st.lists(st.sampled_from(NAMES + [None]), min_size=1, max_size=3))
def test_outputs_colliding_with_inputs_or_each_other_are_refused(tmp_path, outputs, inputs):
    """Random output and input paths (some spelt differently for one file): refused exactly when two name
    one file, with the option of the output and of the input or other output it meets."""
    from scissorhands.tools.paths import check_apart

    root = tmp_path / "case"
    (root / "sub").mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        (root / name).write_text("x")  # inputs exist; an output may or may not
    ins = {f"in{i}": None if n is None else root / n for i, n in enumerate(inputs)}
    outs = {f"out{i}": [root / n] for i, n in enumerate(outputs)}
    canon = [os.path.normpath(n) for n in outputs]
    hits_input = any(n is not None and os.path.normpath(n) in canon for n in inputs)
    hits_output = len(set(canon)) < len(canon)
    if hits_input or hits_output:
        with pytest.raises(ValueError, match=r"^out\d: '.*' (would overwrite the --in\d file|is also written by "
                                             r"--out\d)"):
            check_apart(outs, ins)
    else:
        check_apart(outs, ins)


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, text_file):
    """Two evals into one --out at once would both compute and append every row: the second is refused."""
    from scissorhands.tools.paths import exclusive

    out = tmp_path / "out"
    out.mkdir()
    with exclusive(out, "out"):
        with pytest.raises(ValueError, match=r"^out: '.*' is in use by another run at this moment"):
            grid(out, text_file)
    assert not (out / RESULTS_FILE).exists()
    first = grid(out, text_file)  # free again: runs, then a rerun reuses every row and appends none
    lines = (out / RESULTS_FILE).read_text().splitlines()
    again = grid(out, text_file)
    assert [(r["key_id"], r["value"]) for r in again] == [(r["key_id"], r["value"]) for r in first]
    assert (out / RESULTS_FILE).read_text().splitlines() == lines


def test_a_method_without_a_recent_window_gets_advice_that_can_help(tmp_path, capsys, caplog):
    """tova fixes recent=0 (warned, naming both values); the residual error then says what can help."""
    folder = save_tiny_model(tmp_path / "tiny")
    with caplog.at_level(logging.WARNING):
        code = scissorhands.tools.cli.main(["generate", "--model", str(folder), "--method", "tova", "--recent", "8",
                                            "--kv-bits", "4", "--kv-residual", "4", "--budget", "32", "--prompt",
                                            "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "method 'tova' fixes recent=0; the given recent=8 is not used" in caplog.text
    assert "kv-residual:" in err and "recent is 0" in err and "set --kv-residual to 0" in err
    assert "raise recent" not in err


def test_an_explicit_schedule_is_what_the_banner_prints(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "tiny")
    layers = AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers
    sched = ",".join(["20"] * layers)
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--budget", "50", "--schedule", sched,
                           "--prompt", "hello there, friend of mine", "--max-new-tokens", "3")
    assert code == 0, err
    assert f"budget {sched} per layer (an explicit --schedule; --budget 50 is not used)" in err
