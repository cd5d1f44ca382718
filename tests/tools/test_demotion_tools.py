"""Demotion (``kv_demote``) from the command line: generate reports it, eval refuses a share that cannot fit
(the tiered store: tests/core/test_demotion.py)."""

from conftest import run_cli, save_tiny_model


def test_cli_generate_with_demotion_reports_it(capsys, tmp_path):
    tiny_llama_dir = save_tiny_model(tmp_path / "tiny")
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "hello there " * 20,
                             "--budget", "24", "--kv-bits", "2", "--kv-demote", "16:0.3,4:0.6",
                             "--max-new-tokens", "5")
    assert code == 0, err
    line = next(x for x in err.splitlines() if "demotion: stored tokens at 16 bits" in x)
    shares = [float(p.split()[-1].rstrip("%")) for p in line.split("demotion: stored tokens at ")[1].split(", ")]
    assert len(shares) == 3 and abs(sum(shares) - 100) <= 2 and shares[0] <= 30 + 1 and shares[2] > 0
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "hi", "--budget", "24",
                           "--kv-bits", "2", "--kv-demote", "16:0.9,4:0.5")
    assert code == 2 and err.strip().count("\n") == 0 and "kv-demote" in err


def test_eval_refuses_a_share_that_does_not_fit_before_any_cell(capsys, tmp_path):
    """A width's share too small for a budget's recent window is refused up front, naming kv-demote, with
    nothing written (no full-cache row computed first)."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    capsys.readouterr()  # what saving the model printed
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "eval", "--model", str(model_dir), "--tasks", "ppl", "--text", str(text),
                           "--seq-len", "64", "--num-samples", "1", "--methods", "full,scissorhands",
                           "--budgets", "40", "--kv-bits", "4", "--kv-demote", "8:0.1", "--out", str(out))
    assert code == 2 and "kv-demote" in err and err.strip().count("\n") == 0
    assert not (out / "results.jsonl").exists()
