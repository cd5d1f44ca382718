"""``scissorhands eval --engine vllm``: the generated tasks through vLLM and the plugin, recorded as the transformers
path records them, and paired with it answer by answer.

A tiny random Llama with a byte-level tokenizer answers three HumanEval-shaped problems through the eval grid
(``run_grid``, what the CLI runs) on both engines at the same settings: the transformers side in the project's
environment, the vLLM side here, vLLM alone for the full cache and the plugin at a budget far below the prompts.
Each answer's tokens, text and verdict, and what its cache saw and held, must equal the transformers path's
(float32 on both; a near tie of the random model's logits could part them, which the comparisons of
tests/on_vllm/test_plugin_vllm.py would show first)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import reference_python

HERE = Path(__file__).resolve().parent
MAKE_MODEL = """
import sys
sys.path.insert(0, {tests!r})
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from conftest import byte_tokenizer_fast

tok = byte_tokenizer_fast()
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  tie_word_embeddings=False, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained({folder!r})
tok.save_pretrained({folder!r})
"""
PROBLEM = {
    "entry_point": "add",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
}
NEW = 48  # tokens an answer may take (the random model rarely stops by itself)
GRID = """
import sys
from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import CacheSettings
from scissorhands.tools.eval.humaneval import HumanEval
from scissorhands.tools.eval.runner import run_grid
from scissorhands.tools.models import load_model

folder, problems, out, prefill, new = sys.argv[1:6]
prefill, _, budget = prefill.partition(":")  # "keep-prompt:8": the prefill mode and the budget (default 24)
model, tokenizer = load_model(folder, dtype="float32", device="cpu")
engine = None
if len(sys.argv) > 6:  # the vLLM side, eager (seconds to start)
    from scissorhands.tools.eval.engine import VLLMEngine
    engine = VLLMEngine(folder, "float32", max_num_seqs=4, enforce_eager=True)
run_grid(model, tokenizer, model_name=folder, tasks=[HumanEval(max_new_tokens=int(new), data=problems)],
         methods=[get_method("full"), get_method("scissorhands")], budgets=[int(budget or 24)],
         base=CacheSettings(recent=4, rounds=True, prefill=prefill), out_dir=__import__("pathlib").Path(out),
         engine=engine)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    folder = root / "tiny"
    subprocess.run([reference_python(), "-c", MAKE_MODEL.format(tests=str(HERE.parent), folder=str(folder))],
                   check=True)
    problems = root / "problems.jsonl"
    problems.write_text("".join(json.dumps(dict(PROBLEM, task_id=f"Test/{i}", prompt=PROBLEM["prompt"] + " " * i))
                                + "\n" for i in range(3)))
    return root, folder, problems


def _rows(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["method"]: r for r in rows}


@pytest.mark.parametrize("prefill,budget", [("stream", 24), ("keep-prompt", 8)])
def test_the_engines_give_the_same_answers_and_records(setup, prefill, budget):
    """The streamed prefill (the one whose prompt runs rounds of its own before the plugin's window takes it) and
    the held prompt (a window per request, what an answer held counted as the prompt plus the budget); the
    prompt-aware one is held to the transformers cache token by token in test_plugin_vllm.py."""
    root, folder, problems = setup
    hf_out, vl_out = root / f"hf-{prefill}", root / f"vllm-{prefill}"
    args = [str(folder), str(problems)]
    done = subprocess.run([reference_python(), "-c", GRID, *args, str(hf_out), f"{prefill}:{budget}", str(NEW)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", GRID, *args, str(vl_out), f"{prefill}:{budget}", str(NEW), "vllm"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    hf, vl = _rows(hf_out), _rows(vl_out)
    assert set(hf) == set(vl) == {"full", "scissorhands"}
    for key in hf:
        a, b = hf[key], vl[key]
        assert b["key"]["engine"]["name"] == "vllm" and "engine" not in a["key"]
        assert {k: v for k, v in a["key"].items() if k != "model"} == {
            k: v for k, v in b["key"].items() if k not in ("model", "engine")}  # every setting the same
        assert a["config"] == b["config"]
        for x, y in zip(a["item_scores"], b["item_scores"], strict=True):
            for field in ("completion", "passed", "full_passed", "first_divergence", "new_tokens", "kv_seen",
                          "kv_held"):
                assert x.get(field) == y.get(field), (key, field)
        if key != "full" and prefill == "stream":  # the budget is far below every prompt: the window is all it holds
            assert all(s["kv_held"] == 24 < s["kv_seen"] for s in b["item_scores"])
        if key != "full" and prefill == "keep-prompt":  # the prompt, and the window of 8 after it
            assert all(s["kv_seen"] - s["new_tokens"] + 1 + 8 == s["kv_held"] < s["kv_seen"] for s in b["item_scores"])


def test_the_engine_refuses_what_the_plugin_cannot_run(setup):
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval import make_task
    from scissorhands.tools.eval.engine import check_engine_grid
    from scissorhands.tools.eval.passkey import Passkey

    _, _, problems = setup
    task = make_task("humaneval", 0, 0, str(problems))
    ours = [get_method("scissorhands")]
    base = CacheSettings(rounds=True)
    with pytest.raises(ValueError, match=r"^budgets: the vLLM plugin takes a token count"):
        check_engine_grid("vllm", [task], ours, [0.5], base)
    with pytest.raises(ValueError, match=r"^kv_bits: not supported by the vLLM adapter"):
        check_engine_grid("vllm", [task], ours, [24], CacheSettings(rounds=True, kv_bits=4))
    structured = make_task("humaneval", 0, 0, str(problems), structure=True)
    check_engine_grid("vllm", [structured], ours, [24], base)  # each request's own spans: the plugin protects them
    with pytest.raises(ValueError, match=r"^engine: vllm runs the generated tasks"):
        check_engine_grid("vllm", [make_task("ppl", 64, 1, None)], ours, [24], base)
    check_engine_grid("vllm", [Passkey(protect_facts=True)], ours, [24], base)  # the facts: each request's spans
    check_engine_grid("vllm", [task, make_task("multikey", 0, 0, None)], ours, [24], base)  # what it runs passes


def test_protected_structure_is_checked_for_every_problem_before_the_cell_runs(setup):
    """``--protect-structure`` through vLLM: each problem's spans go to its request, checked first as the plugin
    checks them; a problem whose spans leave no room to evict is named in one line, before any engine starts."""
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval import make_task
    from scissorhands.tools.eval.engine import check_spans, plugin_settings
    from scissorhands.tools.models import load_model

    _, folder, problems = setup
    _, tokenizer = load_model(str(folder), dtype="float32", device="cpu")
    task = make_task("humaneval", 0, 0, str(problems), structure=True)  # the asked function: its whole prompt
    items = task.items(tokenizer, None)
    assert all(item.data["spans"] for item in items)
    method, base = get_method("scissorhands"), CacheSettings(rounds=True, recent=4)
    with pytest.raises(ValueError, match=r"^protect-structure: problem Test/0: \d+ protected tokens do not fit"):
        check_spans(items, plugin_settings(method, 24, base))
    check_spans(items, plugin_settings(method, 24, CacheSettings(rounds=True, recent=4, prefill="keep-prompt")))


PASSKEY_SIDE = """
import json, sys
import torch
from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import CacheSettings
from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs
from scissorhands.tools.models import load_model

from dataclasses import replace

folder, contexts, facts, budget = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
model, _ = load_model(folder, dtype="float32", device="cpu")
base = CacheSettings(recent=4, rounds=True, prefill="stream")
keys = [model.generate(torch.tensor([c]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(c):].tolist()
        for c in contexts]  # the full cache's own continuation: the key each prompt is asked for
setup = ScoreSetup(get_method("scissorhands"), budget, base, 0)
verdicts = [continuation_logprobs(model, c, [k], setup if f is None else
                                  replace(setup, protect=tuple(map(tuple, f))))[0][1]  # as Passkey.score protects
            for c, k, f in zip(contexts, keys, facts)]
print(json.dumps({"keys": keys, "verdicts": verdicts}))
"""


@pytest.mark.parametrize("protect_facts", [False, True])
def test_passkey_through_the_engine_is_the_transformers_paths_verdict(setup, protect_facts):
    """A passkey cell through vLLM is right when the greedy continuation is the key; the transformers path asks the
    same by teacher forcing. With each prompt's key set to the full cache's own continuation (a random model finds
    no planted key), under eviction (64 tokens a layer, a fifth of the 320-token prompts: some continuations
    change, some do not) each prompt's verdict through vLLM and the plugin must be the transformers cache's; with
    ``protect_facts`` each planted key sentence (about 56 tokens) goes to its request as protected spans, as the
    transformers path protects it, at 96 tokens a layer."""
    from transformers import AutoTokenizer

    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval.engine import VLLMEngine, retrieval_scores
    from scissorhands.tools.eval.passkey import Passkey

    root, folder, _ = setup
    text = root / "filler.txt"
    text.write_text((HERE.parent.parent / "README.md").read_text())  # real prose for the filler
    task = Passkey(lengths=(320,), depths=(0.2, 0.5, 0.8), trials=2, data=str(text), protect_facts=protect_facts)
    items = task.items(AutoTokenizer.from_pretrained(str(folder)), None)
    facts = [i.data["facts"] if protect_facts else None for i in items]
    budget = 96 if protect_facts else 64
    assert all(f for f in facts) or not protect_facts
    done = subprocess.run([reference_python(), "-c", PASSKEY_SIDE, str(folder),
                           json.dumps([i.data["ctx"] for i in items]), json.dumps(facts), str(budget)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = json.loads(done.stdout.splitlines()[-1])
    for item, key in zip(items, reference["keys"], strict=True):
        item.data["cont"] = key
    engine = VLLMEngine(str(folder), "float32", max_num_seqs=8, enforce_eager=True)
    base = CacheSettings(recent=4, rounds=True, prefill="stream")
    ours = retrieval_scores(engine, task, items, get_method("scissorhands"), budget, base)
    assert [(s["length"], s["depth"]) for s in ours] == [(i.data["length"], i.data["depth"]) for i in items]
    assert [s["correct"] for s in ours] == reference["verdicts"]


def test_the_engine_ends_a_generation_at_any_of_the_models_end_tokens(setup):
    """``VLLMEngine(ends=)``: the model's end tokens (its generation config's, several for a known Qwen model) end a
    generation on vLLM as they end transformers' ``generate``, the end token kept as the last one."""
    from scissorhands.tools.eval.engine import VLLMEngine

    _, folder, _ = setup
    prompt = list(range(3, 40))
    free = VLLMEngine(str(folder), "float32", max_num_seqs=2, enforce_eager=True).greedy([prompt], 12, [], None)[0]
    end = free[3]
    ended = VLLMEngine(str(folder), "float32", max_num_seqs=2, enforce_eager=True,
                       ends=[end]).greedy([prompt], 12, [], None)[0]
    assert len(free) == 12 and ended == free[:free.index(end) + 1]
