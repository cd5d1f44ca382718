"""Generated tasks under a kept prompt and protected structure: the spans found, the tokens measured, the keys.

* ``structure_spans`` maps the asked problem and a chat template's turn markers to exactly the tokens whose
  characters fall in them (checked against the tokenizer's own offsets, on a tokenizer with ChatML's special
  tokens);
* each answer records the tokens the cache saw and held, and a row their ratio: 1 for a covering budget, and
  under ``prefill="keep-prompt"`` at most the kept prompt plus the budget;
* ``--protect-structure`` cells are keyed apart from plain ones, yet pair with the same full row on file.
"""

from __future__ import annotations

import json
from functools import partial

import pytest

from conftest import CHATML, byte_tokenizer_fast, run_cli, save_tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.tools.eval import make_task
from scissorhands.tools.eval.generated import held_tokens, structure_spans
from scissorhands.tools.eval.gsm8k import GSM8K

SUM = {"id": 0, "short_answer": "3", "choices": ["1 + 2 = 3. So the answer is 3."],
       "context": "Question: What is 5 + 5?\nAnswer: 5 + 5 = 10. So the answer is 10.\n\n"
                  "Question: Tom has 1 apple and gets 2 more. How many apples does he have?\nAnswer:"}


def chat_tokenizer():
    tok = byte_tokenizer_fast()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


def test_structure_spans_are_the_tokens_of_the_asked_problem_and_the_turn_markers():
    tok = chat_tokenizer()
    text = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQuestion: 1 + 1?\nAnswer: 2.\n\n"
            "Question: 2 + 2?<|im_end|>\n<|im_start|>assistant\nAnswer:")
    asked = text.rfind("Question:")
    spans = structure_spans(tok, text, asked)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    chars = set(range(asked, len(text)))
    for marker, role in (("<|im_start|>", True), ("<|im_end|>", False)):
        at = text.find(marker)
        while at >= 0:
            end = text.find("\n", at) + 1 if role else at + len(marker)
            chars |= set(range(at, end))
            at = text.find(marker, at + 1)
    expected = {i for i, (s, e) in enumerate(enc["offset_mapping"]) if chars & set(range(s, e))}
    got = {i for s, e in spans for i in range(s, e)}
    assert got == expected
    assert all(e > s for s, e in spans) and all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # merged, in order
    assert 0 < len(got) < len(enc["input_ids"])
    assert tok.decode(enc["input_ids"][spans[0][0]:spans[0][1]]) == "<|im_start|>system\n"


def test_the_forms_are_the_worked_answers_closing_sentences_and_the_parts_are_named_or_refused():
    """``--protect-structure forms``: each worked example's "So the answer is N." (the form the answer should end
    in), not the asked question; parts are checked by name, and a task without worked answers refuses forms."""
    tok = byte_tokenizer_fast()
    task = make_task("gsm8k", structure="forms")
    assert task.structure == "forms"
    text = task.prompt_text(tok, SUM)
    asked = task.asked_from(text, SUM)
    forms = task.answer_forms(text, asked)
    assert [text[s:e] for s, e in forms] == ["So the answer is 10."]
    spans = structure_spans(tok, text, asked, ("forms",), forms)
    ids = tok(text, add_special_tokens=False).input_ids
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["So the answer is 10."]  # one byte a token here
    both = structure_spans(tok, text, asked, ("asked", "forms"), forms)
    assert both[-1] == (len(tok(text[:asked], add_special_tokens=False).input_ids), len(ids)) and both[0] == spans[0]
    assert make_task("gsm8k", structure="turns,asked").structure is True  # the default parts: the key as before
    assert make_task("gsm8k", structure="forms,asked").structure == "asked,forms"
    for bad in ("shape", "", "asked,,"):
        with pytest.raises(ValueError, match="^protect-structure: parts from asked, turns, forms, code"):
            make_task("gsm8k", structure=bad)
    with pytest.raises(ValueError, match="^protect-structure: forms: mbpp's prompts have no worked answers"):
        make_task("mbpp", structure="forms")


def test_structure_applies_to_the_tasks_that_generate_only():
    with pytest.raises(ValueError, match="^protect-structure: ppl does not generate"):
        make_task("ppl", structure=True)
    task = make_task("gsm8k", structure=True)
    assert task.structure is True
    assert not hasattr(make_task("gsm8k"), "structure")  # a plain task's key stays as it was


def test_the_tokens_held_are_measured_and_a_kept_prompt_holds_its_structure(tmp_path):
    from scissorhands.tools.models import load_model

    model, tokenizer = load_model(str(save_tiny_model(tmp_path / "tiny")))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(SUM) + "\n")
    task = GSM8K(max_new_tokens=20, data=str(data))
    task.protect_structure()
    (item,) = task.items(tokenizer, None)
    prompt = len(item.data["prompt"])
    asked = sum(e - s for s, e in item.data["spans"])
    assert 0 < asked < prompt
    covering = ScissorhandsCache(model, ScissorhandsConfig(budget=prompt + 40))
    judged = task._judged(model, item, covering)
    assert judged["kv_seen"] == judged["kv_held"] == prompt + len(judged["tokens"]) - 1
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=6, recent=2, drop=2, prefill="keep-prompt",
                                                        prompt_keep=0.2), protect=list(item.data["spans"]))
    judged = task._judged(model, item, cache)
    for layer in cache.budgeted_layers:
        kept = int(layer.kv.held[0])
        assert asked <= kept < prompt  # the structure is kept, most of the worked example is not
        for head in layer.stored_positions(0):
            assert {i for s, e in item.data["spans"] for i in range(s, e)} <= set(head.tolist())
    assert judged == {**judged, **held_tokens(cache)}
    assert judged["kv_held"] <= kept + 6 and judged["kv_seen"] == prompt + len(judged["tokens"]) - 1


MBPP_LIKE = ("Sum a list.\n```python\ndef total(xs):\n    s = 0\n    for x in xs:\n        s += x\n"
             "    return s\n```\n\n"
             "Write a function that doubles each item.\nassert double([1, 2]) == [2, 4]\n```python\n")


def test_the_code_part_is_the_asked_problems_defining_and_testing_lines():
    """``--protect-structure code``: the lines of the asked problem's code that define a name or test it (the
    assert naming the function), token for token; the worked examples' code before ``asked`` is left out, and
    the prose and a body's lines are not code structure."""
    from scissorhands.tools.eval.generated import code_lines

    tok = byte_tokenizer_fast()
    text = ("import math\ndef f(a, b: int) -> int:\n    \"\"\"Adds.\n    >>> f(1, 2)\n    3\n    \"\"\"\n"
            "    x, y = a, b\n    total: int = x + y\n    if x == y:\n        return total\n    print(x)\n"
            "    return total\nassert f(1, 2) == 3\n")
    assert [text[s:e].strip() for s, e in code_lines(text)] == [
        "import math", "def f(a, b: int) -> int:", ">>> f(1, 2)", "assert f(1, 2) == 3"]
    asked = MBPP_LIKE.rfind("```\n\n") + 5
    spans = structure_spans(tok, MBPP_LIKE, asked, ("code",))
    ids = tok(MBPP_LIKE, add_special_tokens=False).input_ids
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["assert double([1, 2]) == [2, 4]\n"]  # a byte a token
    assert make_task("mbpp", structure="code,asked").structure == "asked,code"
    with pytest.raises(ValueError, match="^protect-structure: code: gsm8k's prompts ask for no code"):
        make_task("gsm8k", structure="code")


def _experiment(name: str):
    """The script ``experiments/<name>.py`` as a module (the experiments are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "experiments" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gsm8k_grid(tmp_path, monkeypatch, problems: int, new_tokens: int, **model) -> tuple[tuple[str, ...], object]:
    """A tiny model and ``problems`` GSM8K-style problems on disk, answers cut at ``new_tokens``: the command line's
    common arguments for ``scissorhands eval --tasks gsm8k`` into ``tmp_path/out``, and that folder."""
    from scissorhands.tools.eval import catalog

    monkeypatch.setattr(catalog, "GSM8K", partial(GSM8K, max_new_tokens=new_tokens))
    model_dir = save_tiny_model(tmp_path / "tiny", **model)
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(dict(SUM, id=i)) + "\n" for i in range(problems)))
    out = tmp_path / "out"
    return ("eval", "--model", str(model_dir), "--tasks", "gsm8k", "--data", str(data), "--out", str(out)), out


def test_structure_cells_are_keyed_apart_and_pair_with_the_full_row_on_file(tmp_path, capsys, monkeypatch):
    common, out = gsm8k_grid(tmp_path, monkeypatch, 2, 16, chat_template=CHATML)
    code, _, err = run_cli(capsys, *common, "--methods", "full,scissorhands", "--budgets", "8")
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--methods", "full,scissorhands", "--budgets", "8", "--prefill",
                           "keep-prompt", "--prompt-keep", "0.3", "--protect-structure")
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["key"]["task"].get("structure")) for r in rows] == [
        ("full", None), ("scissorhands", None), ("scissorhands", True)]  # one full row serves both
    plain, kept = rows[1], rows[2]
    assert plain["key_id"] != kept["key_id"]
    for row in (plain, kept):
        m = row["metrics"]
        assert m["measured_compression"] == pytest.approx(m["kv_seen_mean"] / m["kv_held_mean"])
        assert m["measured_compression"] > 1
    assert kept["metrics"]["kv_held_mean"] > plain["metrics"]["kv_held_mean"]  # the prompt's structure is kept


@pytest.mark.parametrize("full_limit", [[], ["--limit", "3"]])
def test_a_full_row_over_more_problems_serves_a_run_of_the_first_few(tmp_path, capsys, monkeypatch, full_limit):
    """``--limit N`` pairs with a full row on file over every problem, or over more than N (its first N answers), not
    a second run of the full cache: the verdicts flipped in the file show up as the full cache's."""
    common, out = gsm8k_grid(tmp_path, monkeypatch, 3, 12)
    assert run_cli(capsys, *common, "--methods", "full", *full_limit)[0] == 0
    (full,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for s in full["item_scores"]:
        s["correct"] = 1.0 - s["correct"]
    (out / "results.jsonl").write_text(json.dumps(full) + "\n")
    assert run_cli(capsys, *common, "--methods", "scissorhands", "--budgets", "8", "--limit", "2")[0] == 0
    limited = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert [s["full_correct"] for s in limited["item_scores"]] == [s["correct"] for s in full["item_scores"][:2]]


def test_the_frontier_places_each_row_by_what_it_measured_and_pairs_it(tmp_path, capsys, monkeypatch):
    frontier = _experiment("generation_frontier")
    common, out = gsm8k_grid(tmp_path, monkeypatch, 3, 12)
    assert run_cli(capsys, *common, "--methods", "full,scissorhands,h2o", "--budgets", "8")[0] == 0
    assert run_cli(capsys, *common, "--methods", "scissorhands", "--budgets", "8", "--prefill", "keep-prompt",
                   "--prompt-keep", "0.3")[0] == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert frontier.main([str(out), "--task", "gsm8k", "--plot", str(tmp_path / "f.png")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + 3  # header, rule, and the three compressed rows (the full cache is the pairing)
    ratios = [float(line.split(" | ")[2].rstrip("x")) for line in table[2:]]
    assert ratios == sorted(ratios)
    assert sorted(ratios) == sorted(round(r["metrics"]["measured_compression"], 2) for r in rows[1:])
    assert (tmp_path / "f.png").stat().st_size > 0
    label = table[2].split(" | ")[0].lstrip("| ")
    assert frontier.main([str(out), "--task", "gsm8k", "--against", label]) == 0
    assert "against the reference" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        frontier.main([str(out), "--task", "gsm8k", "--against", "no such row"])


def test_structure_that_leaves_no_room_is_refused_before_any_cell_runs(tmp_path, capsys, monkeypatch):
    """On the transformers path too, each problem's protected structure is planned at every budget before the first
    cell: a budget the asked question fills is one line naming the problem and the budget, and nothing is written
    (it used to stop the grid at that problem, after the cells before it)."""
    common, out = gsm8k_grid(tmp_path, monkeypatch, 2, 12)
    code, _, err = run_cli(capsys, *common, "--methods", "full,scissorhands", "--budgets", "160,64",
                           "--protect-structure", "asked")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("scissorhands: error: protect-structure: problem ") and " at budget 64: " in line, err
    assert not (out / "results.jsonl").exists() or not (out / "results.jsonl").read_text().strip()
    code, _, err = run_cli(capsys, *common, "--methods", "full,scissorhands", "--budgets", "160",
                           "--protect-structure", "asked")
    assert code == 0, err


def test_a_cell_pooled_from_slices_is_its_rows_verdicts_in_order(tmp_path, capsys, monkeypatch):
    """``experiments/pooled_cells.py``: a cell made of two runs (here the same three problems twice, two folders) is
    their verdicts joined, paired with the full cache's joined; a row's first N alone with ``@N``; cells of
    different sizes are refused."""
    pooled = _experiment("pooled_cells")
    common, out = gsm8k_grid(tmp_path, monkeypatch, 3, 12)
    assert run_cli(capsys, *common, "--methods", "full,scissorhands", "--budgets", "8")[0] == 0
    again = tmp_path / "again"
    assert run_cli(capsys, *common[:-1], str(again), "--methods", "full,h2o", "--budgets", "8")[0] == 0
    rows = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    other = [json.loads(line) for line in (again / "results.jsonl").read_text().splitlines()][-1]
    mine = [s["correct"] for s in rows["scissorhands"]["item_scores"]] * 2
    theirs = [s["correct"] for s in other["item_scores"]] + [s["correct"] for s in rows["scissorhands"]["item_scores"]]
    capsys.readouterr()
    assert pooled.main(["--task", "gsm8k", "--cell", "a", str(out), str(out), "--cell", "b", str(again), str(out),
                        "--cell", "c", f"{out}@2", str(out), f"{again}@1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith(f"| a | 6 | {sum(mine) / 6:.3f} | ")
    assert table[3].startswith(f"| b | 6 | {sum(theirs) / 6:.3f} | ")
    assert len(table) == 2 + 3 + 1 + 2 + 3  # three cells, a blank line, then each pair of them
    with pytest.raises(SystemExit):
        pooled.main(["--task", "gsm8k", "--cell", "a", str(out), "--cell", "b", f"{out}@2"])
    assert "cover different numbers of problems: a 3, b 2" in capsys.readouterr().err


def test_the_vllm_grid_checks_every_problems_spans_at_every_budget_before_any_cell(tmp_path):
    """``--engine vllm``: each problem's protected structure, and a passkey task's planted facts, are checked at every
    budget of the grid as the plugin will check them, before the first cell; a budget that covers a problem leaves
    it out (its answer is the full cache's)."""
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval.engine import check_grid_spans
    from scissorhands.tools.eval.passkey import Passkey

    tok = byte_tokenizer_fast()
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(SUM) + "\n")
    task = GSM8K(max_new_tokens=20, data=str(data))
    task.protect_structure(("asked",))
    items = task.items(tok, None)
    ours, base = get_method("scissorhands"), CacheSettings(rounds=True, recent=4)
    check_grid_spans(task, items, ours, [4000], base)  # covered: nothing to check
    check_grid_spans(task, items, get_method("full"), [8], base)  # the full cache protects nothing
    with pytest.raises(ValueError, match=r"^protect-structure: problem 0: \d+ protected tokens do not fit"):
        check_grid_spans(task, items, ours, [4000, 8], base)
    filler = tmp_path / "filler.txt"
    filler.write_text("Once more unto the breach, dear friends, once more. " * 200)
    facts = Passkey(lengths=(400,), depths=(0.5,), data=str(filler), protect_facts=True)
    planted = facts.items(tok, None)
    check_grid_spans(facts, planted, ours, [200], base)
    with pytest.raises(ValueError, match=r"^protect_facts: problem .*: \d+ protected tokens do not fit"):
        check_grid_spans(facts, planted, ours, [200, 24], base)
