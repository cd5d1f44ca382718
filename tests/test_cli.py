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
    (["--budget", "50", "--window-buckets", "-2", "--prompt", "hi"], "window_buckets"),
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
