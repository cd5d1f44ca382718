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
