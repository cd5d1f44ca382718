"""The user guide's tables are the code's: a method or a setting added or renamed in code shows up there."""

from pathlib import Path

from scissorhands.core.methods import methods_table

README = Path(__file__).resolve().parent.parent / "README.md"
USAGE = README.parent / "docs" / "usage.md"


def _between(text: str, marker: str) -> str:
    """What lies between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    start = text.index(f"<!-- {marker} -->\n") + len(f"<!-- {marker} -->\n")
    return text[start:text.index(f"<!-- /{marker} -->")]


def test_usage_guide_lists_the_registered_methods():
    assert _between(USAGE.read_text(), "methods").strip() == methods_table(), (
        "docs/usage.md's method table is out of date; regenerate it from scissorhands.core.methods.methods_table()")
    assert "<!-- methods -->" not in README.read_text()  # one table, in one place


def test_usage_guide_settings_table_is_the_declarations():
    """docs/usage.md's settings table is generated from the fields' declarations (default, help)."""
    from scissorhands.core.settings.config import readme_table

    assert _between(USAGE.read_text(), "settings").strip() == readme_table(), (
        "docs/usage.md's settings table is out of date; regenerate it from "
        "scissorhands.core.settings.config.readme_table()")
    assert "<!-- settings -->" not in README.read_text()  # one table, in one place


def test_every_setting_has_a_flag_and_an_lm_eval_argument():
    """The CLI and the lm-eval backend take every declared setting, under its own name."""
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.core.settings.declare import declared, from_strings
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


ROOT = README.parent
SRC = ROOT / "src" / "scissorhands"


def _doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def _package_modules() -> set[str]:
    return {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")}


def _tree_modules(text: str) -> set[str]:
    """The modules the architecture page's tree lists, as paths under ``src/scissorhands/``."""
    block = text.split("```\nsrc/scissorhands/\n", 1)[1].split("```", 1)[0]
    stack: list[str] = []
    found = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        name = line.split()[0]
        stack = stack[:depth]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        else:
            found.add("/".join([*stack, name]))
    return found


def test_the_architecture_page_lists_every_module_and_no_other():
    listed = _tree_modules((ROOT / "docs" / "architecture.md").read_text())
    modules = _package_modules()
    assert listed == modules, {"not listed": sorted(modules - listed), "no such module": sorted(listed - modules)}
    # The reader has teeth: a module dropped from the tree is seen.
    assert _tree_modules("```\nsrc/scissorhands/\n  core/\n    budget.py   x\n  cli.py  y\n```") == {
        "core/budget.py", "cli.py"}


def _defines(path: Path, name: str) -> bool:
    """Whether a module's source defines, imports or lazily exports ``name``."""
    import re

    text = path.read_text()
    return bool(re.search(rf"(^|\s)(def|class)\s+{name}\b|^{name}\s*[:=]|import .*\b{name}\b|[\"']{name}[\"']",
                          text, re.M))


def _resolves(dotted: str) -> bool:
    """``scissorhands.a.b.Name...``: the longest module prefix exists, and defines the name after it."""
    parts = dotted.split(".")[1:]
    here = SRC
    for i, part in enumerate(parts):
        if (here / part).is_dir() and (here / part / "__init__.py").exists():
            here = here / part
            continue
        if (here / f"{part}.py").exists():
            rest = parts[i + 1:]
            return not rest or _defines(here / f"{part}.py", rest[0])
        return _defines(here / "__init__.py", part)
    return True


def _named_in_docs() -> dict[str, list[str]]:
    """Dotted ``scissorhands.`` names, and paths of the package's, experiments' and tests' files, by document."""
    import re

    files = {"png", "py", "lock", "json", "md", "txt", "jsonl", "gguf", "egg"}
    names: dict[str, list[str]] = {}
    for doc in _doc_files():
        text = doc.read_text()
        found = [m for m in re.findall(r"\bscissorhands(?:\.[A-Za-z_]\w*)+", text) if m.split(".")[1] not in files]
        found += re.findall(r"(?<![\w/.])((?:src/scissorhands/|core/|hf/|vllm/|tools/|experiments/|tests/)"
                            r"[\w/]*\w\.py)\b", text)
        names[doc.name] = found
    return names


def _exists(name: str) -> bool:
    if not name.endswith(".py"):
        return _resolves(name)
    if name.startswith(("experiments/", "tests/")):
        return (ROOT / name).exists()
    return (SRC / name.removeprefix("src/scissorhands/")).exists()


def test_no_document_names_a_module_that_does_not_exist():
    named = _named_in_docs()
    missing = {doc: sorted({n for n in names if not _exists(n)}) for doc, names in named.items()}
    assert not any(missing.values()), missing
    assert sum(map(len, named.values())) > 50  # the reader finds the names the documents hold
    # And it has teeth: names that moved or never were are caught.
    for gone in ("scissorhands.core.kvstore", "scissorhands.core.quant.make_store", "core/kvstore.py",
                 "scissorhands.core.stores.no_such_function", "experiments/no_such_script.py"):
        assert not _exists(gone), gone


def test_docstrings_name_modules_that_exist():
    """``:mod:`` references in the package's docstrings resolve (relative ones against their own package)."""
    import re

    bad = []
    for path in SRC.rglob("*.py"):
        package = ".".join(("scissorhands", *path.relative_to(SRC).parent.parts))
        for ref in re.findall(r":mod:`~?([.\w]+)`", path.read_text()):
            if ref.startswith("."):
                up = len(ref) - len(ref.lstrip("."))
                base = package.split(".")[: len(package.split(".")) - up + 1]
                ref = ".".join(base + [ref.lstrip(".")]) if ref.strip(".") else ".".join(base)
            if ref.startswith("scissorhands") and not _resolves(ref):
                bad.append(f"{path.relative_to(SRC)}: {ref}")
    assert not bad, bad
