"""The command line: one-line errors naming the parameter, and a real run on the default model."""

import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from conftest import left_padded, run_in_process, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "scissorhands.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,param", [
    (["--budget", "5", "--recent", "10", "--prompt", "hi"], "budget"),
    (["--budget", "50", "--recent", "-1", "--prompt", "hi"], "recent"),
    (["--budget", "50", "--window", "0", "--prompt", "hi"], "window"),
    (["--budget", "50", "--window-buckets", "-2", "--prompt", "hi"], "window-buckets"),
    (["--budget", "50", "--drop", "50", "--prompt", "hi"], "drop"),
    (["--budget", "50", "--drop", "1.5", "--prompt", "hi"], "drop"),
    (["--budget", "50", "--importance", "max", "--prompt", "hi"], "importance"),
    (["--budget", "50", "--schedule", "zigzag", "--prompt", "hi"], "schedule"),
    (["--budget", "50", "--prompt", "   "], "prompt"),
    (["--budget", "50", "--prompt-file", "/no/such/file.txt"], "prompt-file"),
    (["--budget", "50", "--max-new-tokens", "0", "--prompt", "hi"], "max-new-tokens"),
    (["--budget", "50", "--model", "/no/such/model", "--prompt", "hi"], "model"),
    (["--budget", "x", "--prompt", "hi"], "--budget"),
])
def test_generate_rejects_bad_arguments_in_one_line(capsys, args, param):
    code, err = run_in_process(capsys, "generate", *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and param in lines[0] and "Traceback" not in err


def test_empty_prompt_file(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, err = run_in_process(capsys, "generate", "--budget", "50", "--prompt-file", str(empty))
    assert code == 2 and "prompt-file:" in err and "empty" in err


def test_one_line_error_from_a_real_subprocess():
    proc = run_cli("generate", "--budget", "5", "--recent", "10", "--prompt", "hi")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "budget:" in proc.stderr


@pytest.mark.slow
def test_generate_on_the_default_model(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The capital of France is Paris. The capital of Italy is Rome. " * 20)
    proc = run_cli("generate", "--budget", "64", "--prompt-file", str(prompt), "--max-new-tokens", "6")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "peak tokens stored in any layer 64" in proc.stderr and "smaller" in proc.stderr


def test_beam_search_reorders_the_cache():
    model = tiny_model("llama")
    ids, mask = left_padded([20, 14], seed=12)
    kw = dict(attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        full = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        ours = model.generate(ids, cache=ScissorhandsCache(model, ScissorhandsConfig(budget=64)), **kw)
        small = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=2))
        model.generate(ids, cache=small, **kw)
    assert torch.equal(full, ours)
    assert small.memory_report()["peak_stored"] <= 12


@pytest.mark.parametrize("old, new, dest, value", [
    (["eval", "--data"], "--text", "text", "t.txt"),
    (["bench", "--contexts"], "--seq-len", "seq_len", "64"),
    (["bench", "--prefill-contexts"], "--prefill-seq-len", "prefill_seq_len", "64"),
    (["analyze", "--windows"], "--num-samples", "num_samples", "3"),
    (["analyze", "--bound-windows"], "--bound-samples", "bound_samples", "3"),
    (["analyze", "--ppl-windows"], "--ppl-samples", "ppl_samples", "3"),
])
def test_old_spellings_still_work_and_say_what_to_use(capsys, old, new, dest, value):
    from scissorhands.tools.cli import build_parser

    args = build_parser().parse_args([*old, value])
    assert getattr(args, dest) == getattr(build_parser().parse_args([old[0], new, value]), dest)
    assert f"{old[1]} is deprecated; use {new}" in capsys.readouterr().err
    assert old[1] not in build_parser().parse_args([old[0]]).__dict__  # hidden: not an option of its own


def test_budget_means_the_same_in_every_command():
    """A token count (> 1) or a fraction (<= 1) of the sequence: generate, eval, bench and analyze alike."""
    from scissorhands.tools.bench_cli import config_from_args
    from scissorhands.tools.cli import build_parser, cache_settings, job

    gen = build_parser().parse_args(["generate", "--budget", "0.25", "--prompt", "x", "--recent", "2"])
    assert job(gen).config is None  # a fraction waits for the prompt's length
    assert job(gen).plan(tiny_model("llama"), 400).config.budget == 100  # the plan makes it tokens
    assert job(build_parser().parse_args(["generate", "--budget", "100", "--prompt", "x"])).config.budget == 100
    bench = build_parser().parse_args(["bench", "--budgets", "0.25,100", "--seq-len", "400"])
    cfg, _ = config_from_args(bench, cache_settings(bench))
    assert cfg.budgets == (0.25, 100.0)
    from scissorhands.tools.bench import budget_tokens

    assert [budget_tokens(f, 400) for f in cfg.budgets] == [100, 100]
