"""HumanEval with execution: the program runner, the task through the grid, and the real default model."""

from __future__ import annotations

import json

import pytest

from conftest import CHATML, run_cli, save_tiny_model
from scissorhands.tools.eval.humaneval import CHAT_STOPS, HumanEval, cut_at_stop, program_of, read_problems, run_program
from scissorhands.tools.stats import mcnemar_p

ADD = {
    "task_id": "Test/0", "entry_point": "add",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
}


def test_a_program_passes_only_when_it_exits_cleanly():
    assert run_program(program_of(ADD, ADD["canonical_solution"])) == (True, "")
    passed, why = run_program(program_of(ADD, "    return a - b\n"))
    assert not passed and why == "AssertionError"
    passed, why = run_program(program_of(ADD, "    return a +\n"))
    assert not passed and why.startswith("SyntaxError")


def test_a_program_gets_no_network_no_endless_time_and_no_endless_memory():
    passed, why = run_program("import socket\nsocket.socket()\n")
    assert not passed and "network access is disabled" in why
    passed, why = run_program("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')\n")
    assert not passed and "network access is disabled" in why
    passed, why = run_program("import os\nos.fork()\nwhile True:\n    pass\n", timeout=1.0)
    assert (passed, why) == (False, "timed out after 1 s")
    passed, why = run_program("x = bytearray(8 * 2**30)\n")
    assert not passed and why == "MemoryError"


def test_a_program_runs_in_a_scratch_folder_with_an_empty_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SCISSORHANDS_SECRET", "1")
    monkeypatch.chdir(tmp_path)
    assert run_program("import os\nassert 'SCISSORHANDS_SECRET' not in os.environ\n"
                       f"assert os.getcwd() != {str(tmp_path)!r}\nopen('left.txt', 'w').write('x')\n")[0]
    assert not (tmp_path / "left.txt").exists()


def test_a_completion_ends_at_the_next_top_level_statement():
    assert cut_at_stop("    return a + b\n\n\ndef other():\n    pass") == "    return a + b\n\n"
    assert cut_at_stop("    return a + b\n\nif __name__ == '__main__':\n") == "    return a + b\n"
    assert cut_at_stop("    if a:\n        return b\n    # note\n    return a") == (
        "    if a:\n        return b\n    # note\n    return a")  # indented: the function goes on


def test_mcnemar_exact_p_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(3, 3) == 1.0
    assert mcnemar_p(6, 0) == pytest.approx(2 / 64)
    assert mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)


def test_the_shipped_problems_are_human_evals_164():
    problems = read_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    first = problems[0]
    assert run_program(program_of(first, first["canonical_solution"]))[0]  # its own solution passes its tests


def test_a_problems_file_lacking_a_field_is_one_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({k: v for k, v in ADD.items() if k != "test"}) + "\n")
    with pytest.raises(ValueError, match=r"^data: .* line 1 lacks test$"):
        read_problems(str(bad))
    with pytest.raises(ValueError, match=r"^data: no such file"):
        read_problems(str(tmp_path / "none.jsonl"))


def test_a_problems_line_that_is_not_json_names_the_file_and_the_line_gzipped_or_not(tmp_path, capsys):
    import gzip

    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps(ADD) + "\n{not json}\n")
    packed = tmp_path / "p.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        code, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "no-model"), "--tasks", "humaneval",
                               "--text", str(path))
        assert code == 2 and err.strip().splitlines()[-1] == f"scissorhands: error: data: '{path}' line 2 is not JSON"


def test_humaneval_through_the_grid_pairs_every_cell_with_the_full_cache(tmp_path, capsys):
    """A tiny random model through ``scissorhands eval --tasks humaneval``: every row holds pass@1, the full
    cache's pass@1 on the same problems, the paired difference and where the answers part; the full row's
    answers are the full cache's own (first divergence at their end)."""
    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir)
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(dict(ADD, task_id=f"Test/{i}")) + "\n" for i in range(3)))
    code, out, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", "humaneval", "--data",
                             str(problems), "--methods", "full,scissorhands", "--budgets", "24", "--out",
                             str(tmp_path / "out"))
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["full", "scissorhands"]
    full, ours = rows
    for row in rows:
        m = row["metrics"]
        assert m["n"] == 3 and 0 <= m["pass@1"] <= 1 and m["full_pass@1"] == full["metrics"]["pass@1"]
        assert m["diff_vs_full"] == pytest.approx(m["pass@1"] - m["full_pass@1"])
        assert m["lost"] - m["gained"] == round(-3 * m["diff_vs_full"])
        assert len(m["first_divergence"]) == 3
    assert all(s["first_divergence"] == s["new_tokens"] for s in full["item_scores"])  # the full cache's own
    assert ours["mean_budget"] == 24 and ours["mean_length"] > 24  # prompt + canonical solution, in tokens


def test_a_later_run_pairs_with_the_full_answers_on_file(tmp_path, capsys):
    """A method added to a folder later is paired with the full row already there, not with a second run of the
    full cache: with that row's verdicts flipped on file, the new cell reports the flipped ones as the full
    cache's. A row that kept no tokens (written before rows kept them) is not taken: the full cache runs again."""
    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir)
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(dict(ADD, task_id=f"Test/{i}")) + "\n" for i in range(3)))
    out = tmp_path / "out"
    results = out / "results.jsonl"

    def run(*args):
        code, _, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", "humaneval", "--data",
                               str(problems), "--out", str(out), *args)
        assert code == 0, err
        return [json.loads(line) for line in results.read_text().splitlines()]

    (full,) = run("--methods", "full")
    truth = [s["passed"] for s in full["item_scores"]]
    assert all(isinstance(s["tokens"], list) and len(s["tokens"]) == s["new_tokens"] for s in full["item_scores"])
    for s in full["item_scores"]:
        s["passed"] = 1.0 - s["passed"]
    results.write_text(json.dumps(full) + "\n")
    taken = run("--methods", "full,scissorhands", "--budgets", "24")[-1]
    assert [s["full_passed"] for s in taken["item_scores"]] == [1.0 - t for t in truth]

    for s in full["item_scores"]:
        del s["tokens"]
    results.write_text(json.dumps(full) + "\n")
    again = run("--methods", "full,scissorhands", "--budgets", "20")[-1]
    assert [s["full_passed"] for s in again["item_scores"]] == truth


def test_the_chat_task_asks_through_the_template_and_stops_where_its_block_closes(tmp_path, capsys):
    """``humaneval-chat``: the prompt is the template's turns, the assistant's opened with a code block holding
    the problem's prompt; a completion ends where that block closes; the grid pairs its cells with the full cache
    as for the plain task, under its own name, and a budget's fraction counts the template's tokens."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir, chat_template=CHATML)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = HumanEval(chat=True).prompt_text(tokenizer, ADD)
    assert text.startswith("<|im_start|>user\nComplete the following Python function.")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n```python\n" + ADD["prompt"])
    assert HumanEval().prompt_text(tokenizer, ADD) == ADD["prompt"]
    assert cut_at_stop("    return a + b\n```\n\nThis adds.", CHAT_STOPS) == "    return a + b"
    assert cut_at_stop("    return a + b\n```") == "    return a + b\n```"  # the plain task has no block

    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(dict(ADD, task_id=f"Test/{i}")) + "\n" for i in range(2)))
    lengths = {}
    for task in ("humaneval", "humaneval-chat"):
        code, _, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", task, "--data", str(problems),
                               "--methods", "full,scissorhands", "--budgets", "0.5", "--out", str(tmp_path / task))
        assert code == 0, err
        rows = [json.loads(line) for line in (tmp_path / task / "results.jsonl").read_text().splitlines()]
        assert [(r["task"], r["method"]) for r in rows] == [(task, "full"), (task, "scissorhands")]
        assert rows[1]["metrics"]["n"] == 2 and rows[1]["metrics"]["full_pass@1"] == rows[0]["metrics"]["pass@1"]
        lengths[task] = rows[1]["mean_length"]
    ask = len(tokenizer(text, add_special_tokens=False).input_ids) - len(tokenizer(ADD["prompt"]).input_ids)
    assert lengths["humaneval-chat"] == lengths["humaneval"] + ask  # the template's tokens count in the budget


def test_the_tasks_keys_are_those_of_the_records_on_file():
    """A cell's key holds its task's identity (its public attributes): the plain task's must stay what the records
    in docs/ were keyed by, or a run into their folder would score their cells again; the chat task's differs."""
    from pathlib import Path

    from scissorhands.tools.eval.records import task_identity

    results = Path(__file__).resolve().parents[2] / "docs" / "results" / "humaneval"
    for folder, task in (("q05_164", HumanEval()), ("q15", HumanEval()), ("q05_chat", HumanEval(chat=True))):
        record = json.loads((results / folder / "results.jsonl").read_text().splitlines()[0])
        assert record["key"]["task"] == task_identity(task), folder
    assert task_identity(HumanEval()) != task_identity(HumanEval(chat=True))


def test_the_chat_task_on_a_model_without_a_template_is_one_line(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir)
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(ADD) + "\n")
    code, _, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", "humaneval-chat", "--data",
                           str(problems), "--methods", "full", "--out", str(tmp_path / "out"))
    assert code != 0
    assert "tasks: humaneval-chat needs a model whose tokenizer has a chat template" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_the_real_default_model_writes_code_that_passes_and_a_covering_budget_changes_nothing(tmp_path):
    """SmolLM2-135M completes a real problem; a budgeted cache as large as the whole sequence gives the same
    tokens, so the same verdict; a budget far below the prompt still gives a program that is run and judged; the
    same through its chat template."""
    from scissorhands import ScissorhandsCache, ScissorhandsConfig
    from scissorhands.tools.eval.base import Item
    from scissorhands.tools.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    task = HumanEval(max_new_tokens=48)
    problem = dict(ADD, prompt=ADD["prompt"] + "    return")
    (item,) = [Item(problem["task_id"], 0, {"problem": problem, "prompt": tokenizer(problem["prompt"]).input_ids})]
    task._tokenizer = tokenizer
    full = task._full(model, item)
    assert full["passed"], full  # " a + b"
    covering = task._judged(model, item, ScissorhandsCache(model, ScissorhandsConfig(budget=512)))
    assert covering["tokens"] == full["tokens"] and covering["passed"]
    tight = task._judged(model, item, ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=4)))
    assert isinstance(tight["passed"], bool) and tight["tokens"]

    # Through its chat template (SmolLM2's tokenizer has one): the covering budget again changes nothing.
    problems = tmp_path / "add.jsonl"
    problems.write_text(json.dumps(ADD) + "\n")
    chat = HumanEval(max_new_tokens=48, chat=True, data=str(problems))
    (item,) = chat.items(tokenizer, 1)
    assert tokenizer.decode(item.data["prompt"]) == chat.prompt_text(tokenizer, ADD)
    full = chat._full(model, item)
    covering = chat._judged(model, item, ScissorhandsCache(model, ScissorhandsConfig(budget=1024)))
    assert covering["tokens"] == full["tokens"] and covering["passed"] == full["passed"]
