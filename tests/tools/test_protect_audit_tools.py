"""Protection and the eviction audit from generate and the command line (against the naive reference:
tests/core/test_protect_audit.py)."""

import json

import pytest

from conftest import byte_tokenizer_fast, save_tiny_model
from scissorhands import EvictionAudit, ScissorhandsConfig
from scissorhands.tools.cli import main
from scissorhands.tools.generation import generate

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    tok = byte_tokenizer_fast()
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_tokenizer_model(tiny_model_dir):
    from scissorhands.tools.models import load_model

    return load_model(str(tiny_model_dir))


def test_generate_with_protection_and_audit_writes_json_and_png(tmp_path, tiny_tokenizer_model):
    model, tok = tiny_tokenizer_model
    audit = EvictionAudit(spans={"head": (0, 6)})
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    result = generate(model, tok, prompt, ScissorhandsConfig(budget=24), max_new_tokens=8, protect=[(0, 6)],
                      audit=audit, ignore_eos=True)
    assert result.memory["peak_stored"] <= 24
    summary = audit.summary(result.cache)
    assert all(v == 1.0 for v in summary["spans"]["head"]["held_fraction"].values())
    assert summary["spans"]["head"]["first_evicted_step_any_layer"] is None
    record = audit.to_json(tmp_path / "audit.json", result.cache)
    assert json.loads((tmp_path / "audit.json").read_text())["spans"] == json.loads(json.dumps(record["spans"]))


def test_cli_protect_prefix_and_audit(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "audit.json"
    prompt = "word " * 80
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "24", "--prompt", prompt,
                 "--max-new-tokens", "4", "--ignore-eos", "--protect-prefix", "5", "--audit", str(out),
                 "--audit-events"])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["spans"]["protected"]["first_evicted_step_any_layer"] is None
    assert record["spans"]["prompt"]["first_evicted_step_any_layer"] is not None
    assert all(len(t["step"]) == sum(record["evicted"][k]) for k, t in record["events"].items())
    assert out.with_suffix(".png").stat().st_size > 1000
    err = capsys.readouterr().err
    assert "[audit] prompt 0-" in err and "protected 0-5: 100% held (layer min 100%), never evicted" in err


def test_cli_protect_system_pins_the_system_turn(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "audit.json"
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "40", "--system", "code 12345",
                 "--protect-system", "--prompt", "word " * 60, "--max-new-tokens", "4", "--ignore-eos",
                 "--audit", str(out)])
    assert code == 0, capsys.readouterr().err
    spans = json.loads(out.read_text())["spans"]
    n_system = len("<system>code 12345</system>\n")  # one token per byte
    assert spans["system"]["end"] == spans["protected"]["end"] == n_system
    assert spans["system"]["first_evicted_step_any_layer"] is None
    assert all(v == 1.0 for v in spans["system"]["held_fraction"].values())
    assert spans["prompt"]["first_evicted_step_any_layer"] is not None


@pytest.mark.parametrize("args,message", [
    (["--protect-prefix", "-1"], "protect-prefix: must be >= 1"),
    (["--protect-prefix", "40"], "protect-prefix: 40 protected tokens do not fit"),
    (["--protect-system"], "protect-system: needs --system"),
    (["--audit-events"], "audit-events: needs --audit"),
])
def test_cli_bad_protection_is_one_line(args, message, capsys, tiny_model_dir):
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "24", "--prompt", "word " * 30,
                 "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
