"""What a new user meets first: fast help, fast failures, one-line interrupts, readable results."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scissorhands
from scissorhands.core.settings.names import BUILTIN_METHODS

SRC = str(Path(scissorhands.__file__).resolve().parents[1])

# An import hook that refuses the heavy libraries: --help and --version must answer without them.
NO_HEAVY = r"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "matplotlib", "tqdm", "gguf", "numpy"):
            raise ImportError(f"{name} imported by --help")
        return None
sys.meta_path.insert(0, Refuse())
from scissorhands.tools.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["demo", "--help"],
                                  ["eval", "--help"], ["analyze", "--help"], ["bench", "--help"],
                                  ["calibrate", "--help"]])
def test_help_and_version_import_no_heavy_library(argv):
    proc = subprocess.run([sys.executable, "-c", NO_HEAVY, *argv], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "imported by --help" not in proc.stderr
    assert proc.stdout.strip()


def test_the_help_lists_every_builtin_method_in_registry_order():
    from scissorhands.core.methods import METHODS

    assert BUILTIN_METHODS == tuple(n for n in METHODS if METHODS[n].__module__.startswith("scissorhands."))


@pytest.mark.parametrize("delay", [0.3, 1.0, 2.5])
def test_ctrl_c_in_the_first_seconds_is_one_line(tmp_path, delay):
    """Ctrl-C while Python starts, torch imports or the model loads: one line (or nothing, if it lands before
    Python's handler exists), never a traceback."""
    import signal
    import time

    from conftest import save_tiny_model, sigint_as_in_a_terminal

    folder = save_tiny_model(tmp_path / "tiny")
    proc = subprocess.Popen([sys.executable, "-m", "scissorhands.tools.cli", "generate", "--model", str(folder),
                             "--budget", "40", "--prompt", "hello", "--max-new-tokens", "500"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=sigint_as_in_a_terminal)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert "Traceback" not in err, err
    if proc.returncode != 0:  # it may have finished before the signal on a fast machine
        assert proc.returncode in (130, -signal.SIGINT), err
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines[-1:] in ([], ["scissorhands: interrupted"]), err


def test_ctrl_c_inside_a_finalizer_still_ends_the_run_in_one_line():
    """Python swallows a KeyboardInterrupt raised in a ``__del__`` (it prints "Exception ignored" and a
    traceback, then carries on). A Ctrl-C landing in a library's finalizer while transformers imports did
    exactly that; the command line delivers it again, so the run still ends with its one line."""
    script = (
        "import sys, time\n"
        "from scissorhands.tools.cli import interrupt_in_finalizers, say\n"
        "interrupt_in_finalizers()\n"
        "class Held:\n"
        "    def __del__(self):\n"
        "        raise KeyboardInterrupt\n"
        "try:\n"
        "    Held()\n"
        "    for _ in range(50):\n"
        "        time.sleep(0.01)\n"
        "    print('carried on')\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(say('interrupted', 130))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=60)
    assert "carried on" not in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["scissorhands: interrupted"]


def test_the_interrupt_line_starts_on_its_own_line_after_a_progress_bar(capsys, monkeypatch):
    from tqdm.auto import tqdm

    from scissorhands.tools import cli

    bar = tqdm(total=10, desc="working", file=sys.stderr)
    bar.update(3)
    code = cli.say("interrupted", 130)
    err = capsys.readouterr().err
    assert code == 130
    assert err.endswith("\nscissorhands: interrupted\n")
    assert "working" in err.split("\nscissorhands: interrupted")[0]


def _tiny_generation():
    import torch

    from conftest import byte_tokenizer_fast, tiny_model

    torch.manual_seed(0)
    return tiny_model("llama"), byte_tokenizer_fast()


def test_answer_cost_is_zero_when_nothing_is_evicted_and_equals_token_by_token_decoding():
    import torch
    from transformers import DynamicCache

    from scissorhands import ScissorhandsCache, ScissorhandsConfig
    from scissorhands.tools.generation import answer_cost

    model, tok = _tiny_generation()
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    answer = torch.randint(3, 100, (12,))
    same = answer_cost(model, tok, prompt, answer, ScissorhandsConfig(budget=1000))
    assert abs(same.delta_nll) < 1e-6 and same.tokens == 12  # budget >= length: the full cache's numbers
    cfg = ScissorhandsConfig(budget=24, recent=4, drop=4)
    cost = answer_cost(model, tok, prompt, answer, cfg)
    # The naive reference: feed the prompt, then the answer one token at a time, under each cache.
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    lps = []
    with torch.no_grad():
        for cache in (ScissorhandsCache(model, cfg), DynamicCache(config=model.config)):
            logits = [model(ids, cache=cache).logits[:, -1]]
            for t in answer[:-1]:
                logits.append(model(t.view(1, 1), cache=cache).logits[:, -1])
            lp = torch.log_softmax(torch.cat(logits).float(), -1).gather(-1, answer[:, None])[:, 0]
            lps.append(lp)
    assert cost.delta_nll == pytest.approx(float((lps[1] - lps[0]).mean()), abs=1e-5)
    assert cost.delta_nll != 0.0  # the budget evicted: the cost is measured, not assumed
    assert cost.tokens == 12 and 0.0 <= cost.agreement <= 1.0


def test_compare_full_prints_both_texts_and_the_measured_cost(tmp_path, capsys):
    from conftest import run_cli, save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    code, out, err = run_cli(capsys, "generate", "--model", str(folder), "--budget", "24", "--recent", "4",
                             "--prompt", "All work and no play makes Jack a dull boy. " * 3, "--max-new-tokens", "8",
                             "--compare-full")
    assert code == 0, err
    assert out.startswith("--- scissorhands, budget 24 ---\n")
    assert "\n--- full cache ---\n" in out
    assert "tokens: " in out and "at most 24 stored per layer and KV head" in out
    assert "KV bytes: " in out and "cost: " in out and "nats/token" in out and "agrees on" in out


def test_the_demo_prompt_is_the_excerpt_and_the_question():
    from scissorhands.tools.generation import DEMO_QUESTION, demo_chat, demo_prompt

    _, tok = _tiny_generation()
    text = demo_chat(tok)  # no chat template: plain text
    assert text.rstrip().endswith(DEMO_QUESTION)
    assert demo_prompt().startswith(text.split("\n\n" + DEMO_QUESTION)[0])


def test_the_lm_eval_docs_table_is_the_backend_and_the_declarations():
    from scissorhands.tools.lm_eval_backend import ScissorhandsLM
    from scissorhands.tools.lm_eval_help import model_args_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "lm_eval.md").read_text()
    start = text.index("<!-- model-args -->\n") + len("<!-- model-args -->\n")
    assert text[start:text.index("<!-- /model-args -->")].strip() == model_args_table(ScissorhandsLM), (
        "docs/lm_eval.md's table is out of date; regenerate it from scissorhands.tools.lm_eval_help")
    import inspect

    own = [p for p in inspect.signature(ScissorhandsLM.__init__).parameters
           if p not in ("self", "tokenizer", "max_batch_size", "settings")]
    assert all(f"| `{name}` |" in text for name in own)  # every argument the backend takes is documented


def test_the_lm_eval_command_runs_offline_on_a_shipped_task_and_its_help_names_our_arguments(tmp_path):
    """The user guide's lm-eval command, offline, from a folder that is not the repository, on a tiny model."""
    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    env = dict(_env(), HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "datasets"))
    base = [sys.executable, "-m", "scissorhands.tools.lm_eval_backend"]
    # kv_demote spelled with ';', which lm-eval's splitting of --model_args at commas leaves whole.
    proc = subprocess.run([*base, "--model", "scissorhands", "--model_args",
                           f"model={folder},budget=0.3,kv_bits=4,kv_demote=16:0.4;8:0.6",
                           "--tasks", "scissorhands_tiny_mc", "--limit", "2"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scissorhands_tiny_mc" in proc.stdout and "acc" in proc.stdout
    helped = subprocess.run([*base, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.startswith("scissorhands model type for lm-eval")
    for name in ("budget", "method", "recent", "kv_bits", "prefill"):
        assert f"\n  {name} " in helped.stdout


def _captured_figures(monkeypatch):
    """Figures a plotting function closes, kept for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    real = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or real(fig))
    return figures


def _rows():
    """Result rows as the eval grid writes them: ppl (per-window NLL) and a multiple-choice task."""
    def row(task, method, budget, values, compression):
        if task == "ppl":
            scores = [{"nll": v} for v in values]
            mean = sum(values) / len(values)
            metrics = {"nll": mean, "ppl": math.exp(mean), "ppl_ci95": [math.exp(mean - 0.1), math.exp(mean + 0.1)]}
            value, metric = metrics["ppl"], "ppl"
        else:
            scores = [{"correct": bool(v), "correct_norm": bool(v)} for v in values]
            acc = sum(values) / len(values)
            metrics = {"acc": acc, "acc_stderr": 0.1, "acc_norm": acc, "acc_norm_stderr": 0.1}
            value, metric = acc, "acc"
        return {"task": task, "method": method, "budget": budget, "model": "m", "metric": metric, "value": value,
                "metrics": metrics, "compression": compression, "item_scores": scores}

    return [row("ppl", "full", None, [3.0, 3.2, 2.9, 3.1], 1.0),
            row("ppl", "scissorhands", 0.2, [3.05, 3.3, 2.95, 3.1], 5.0),
            row("piqa", "full", None, [1, 1, 0, 1], 1.0), row("piqa", "scissorhands", 0.2, [1, 0, 0, 1], 5.0)]


def test_summary_leads_with_the_paired_differences_to_the_full_cache():
    from scissorhands.tools.eval.report import summary_markdown

    text = summary_markdown(_rows())
    assert text.startswith("## Against the full cache")
    head, rest = text.split("## Every result")
    row = next(line for line in head.splitlines() if line.startswith("| scissorhands | 0.2 |"))
    assert "+0.0500 ±" in row  # ΔNLL: mean of 0.05, 0.1, 0.05, 0.0
    assert "-25.0 ±" in row and "pts" in row  # Δacc: one of four items lost
    assert "| method | budget | ppl | piqa |" in rest


def test_one_item_prints_no_interval_rather_than_nan():
    """A single window (as at 16,384 tokens) has no interval: the tables say so instead of printing ±nan."""
    from scissorhands.tools.eval.report import summary_markdown
    from scissorhands.tools.eval.tasks import Perplexity
    from scissorhands.tools.stats import NO_INTERVAL

    rows = []
    for method, budget, nll in [("full", None, 3.0), ("scissorhands", 0.2, 3.02)]:
        metrics = Perplexity().aggregate([{"nll": nll}])
        rows.append({"task": "ppl", "method": method, "budget": budget, "metrics": metrics,
                     "compression": 1.0 if budget is None else 5.0, "item_scores": [{"nll": nll}]})
    text = summary_markdown(rows)
    assert "nan" not in text.lower()
    assert f"| scissorhands | 0.2 | +0.0200 {NO_INTERVAL} (5.0x) |" in text
    assert f"| full | full | {math.exp(3.0):.2f} {NO_INTERVAL} (1.0x) |" in text
    assert text.endswith(f"{NO_INTERVAL}: one item, so no interval.")
    assert NO_INTERVAL not in summary_markdown(_rows())  # several items: intervals, and no note


def test_eval_plots_carry_their_intervals(tmp_path, monkeypatch):
    from scissorhands.tools.eval.report import plot_results

    figures = _captured_figures(monkeypatch)
    plot_results(_rows(), tmp_path)
    ppl = figures[0].axes[0]
    assert ppl.containers and any(len(c.lines) > 1 and c.lines[2] for c in ppl.containers)  # error bars drawn
    assert any(p.get_alpha() for p in ppl.patches)  # the full cache's 95% band


def test_bench_throughput_plot_has_the_full_cache_at_the_budget(tmp_path, monkeypatch):
    from conftest import tiny_model
    from scissorhands import CacheSettings
    from scissorhands.tools.bench import BenchConfig, run_bench
    from scissorhands.tools.bench_report import plot

    cfg = BenchConfig(contexts=(32, 64), batches=(1,), budgets=(0.5,), steps=2, warmup=1, parts=("decode",),
                      settings=CacheSettings(recent=4))
    result = run_bench(tiny_model("llama"), cfg)
    figures = _captured_figures(monkeypatch)
    assert plot(result, tmp_path) == ["throughput.png"]
    labels = figures[0].axes[0].get_legend_handles_labels()[1]
    assert "full cache at the budget of scissorhands 0.5, batch 1" in labels


def test_the_audit_map_labels_the_prompt_and_the_generated_tokens(tmp_path, monkeypatch):
    import torch

    from scissorhands import ScissorhandsCache, ScissorhandsConfig
    from scissorhands.tools.plots import plot_held_map

    model, _ = _tiny_generation()
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24, recent=4))
    with torch.no_grad():
        model.generate(torch.randint(3, 100, (1, 40)), cache=cache, max_new_tokens=10, do_sample=False,
                       pad_token_id=0)
    figures = _captured_figures(monkeypatch)
    plot_held_map(cache, tmp_path / "map.png", spans={"prompt": (0, 40), "protected": (0, 4)})
    texts = [t.get_text() for t in figures[0].axes[0].texts]
    # 10 new tokens, of which the cache has seen 9 (the last one is never fed back)
    assert "prompt [0, 40)" in texts and "generated [40, 49)" in texts and "protected [0, 4)" in texts
