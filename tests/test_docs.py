"""The README's method list is the registry's: a method added or renamed in code shows up here."""

from pathlib import Path

from scissorhands.core.methods import methods_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_the_registered_methods():
    text = README.read_text()
    start = text.index("<!-- methods -->\n") + len("<!-- methods -->\n")
    end = text.index("<!-- /methods -->")
    assert text[start:end].strip() == methods_table(), (
        "README's method table is out of date; regenerate it from scissorhands.core.methods.methods_table()")


def test_readme_settings_table_is_the_declarations():
    """The README's settings table is generated from the fields' declarations (default, help)."""
    from scissorhands.core.config import readme_table

    text = README.read_text()
    start = text.index("<!-- settings -->\n") + len("<!-- settings -->\n")
    end = text.index("<!-- /settings -->")
    assert text[start:end].strip() == readme_table(), (
        "README's settings table is out of date; regenerate it from scissorhands.core.config.readme_table()")


def test_every_setting_has_a_flag_and_an_lm_eval_argument():
    """The CLI and the lm-eval backend take every declared setting, under its own name."""
    from scissorhands.core.config import CacheSettings
    from scissorhands.core.settings import declared, from_strings
    from scissorhands.tools.cli import build_parser

    names = [name for name, _, _ in declared(CacheSettings)]
    for command in (["generate", "--budget", "30", "--prompt", "x"], ["eval"], ["bench"]):
        given = build_parser().parse_args([*command, "--recent", "7", "--window", "none", "--no-merge"])
        assert (given.recent, given.window, given.merge) == (7, None, False)
        absent = build_parser().parse_args(command)
        assert not any(hasattr(absent, name) for name in names)  # not given: the preset or the default decides
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        switch = name in ("value_weighted", "merge", "rounds")
        assert hasattr(build_parser().parse_args(["eval", flag] if switch else ["eval", flag, "1"]), name)
    parsed = from_strings(CacheSettings, {"window": "none", "recent": "0.5", "kv_bits": "4", "merge": "true"})
    assert parsed == {"window": None, "recent": 0.5, "kv_bits": 4, "merge": True}
