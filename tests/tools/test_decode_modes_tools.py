"""The static decode step from the command line (the step: tests/core/test_decode_modes.py)."""

from conftest import run_cli


def test_cli_generate_with_static_decode(capsys, tmp_path):
    """The CLI flag reaches the cache: the same text as the default step."""
    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "m")
    texts = []
    for decode in ("dynamic", "static"):
        code, out, err = run_cli(capsys, "generate", "--model", str(folder), "--budget", "12", "--prompt",
                                 "hello there, world", "--max-new-tokens", "20", "--decode", decode)
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1] and texts[0].strip()
