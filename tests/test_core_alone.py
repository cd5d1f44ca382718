"""The core's tests stand alone: tests/core imports neither transformers, nor the adapters, nor the tools.

Read from the source (every import in tests/core, at any depth), then proven by running: pytest collects
tests/core and runs two of its tests in a process where those imports fail. What crosses into transformers lives
in tests/hf, what drives the tools in tests/tools.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE_TESTS = ROOT / "tests" / "core"
BLOCKED = ("transformers", "scissorhands.hf", "scissorhands.tools", "scissorhands.vllm", "vllm")

# Installed before pytest starts: any import of a blocked module (or of a module inside one) fails.
BLOCKER = f"""
import sys
from importlib.abc import MetaPathFinder

BLOCKED = {BLOCKED!r}


class Blocked(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}}: blocked (the core's tests run without it)")
        return None


for name in [m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED)]:
    del sys.modules[name]
sys.meta_path.insert(0, Blocked())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


# Test modules elsewhere, which tests/core may not import from: they import transformers (``profiles`` is the
# hypothesis profiles and ``workers`` each xdist worker's share of the cores, both shared by every folder).
OUTSIDE = {p.stem for folder in ("tests", "tests/hf", "tests/tools") for p in (ROOT / folder).glob("*.py")}
OUTSIDE -= {"profiles", "workers"}


def forbidden_imports(path: Path) -> list[str]:
    """``file:line: module`` for each import in ``path`` that tests/core may not make: a blocked module, a test
    module of another folder, or any name from the package's top level (``from scissorhands import X`` resolves X
    wherever it lives, the adapter included)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name == "scissorhands" or name.split(".")[0] in OUTSIDE or any(
                    name == b or name.startswith(b + ".") for b in BLOCKED):
                found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_no_core_test_imports_transformers_an_adapter_or_a_tool():
    files = sorted(CORE_TESTS.glob("*.py"))
    assert len(files) > 10
    found = [line for path in files for line in forbidden_imports(path)]
    assert not found, "tests/core must stay framework-free:\n" + "\n".join(found)


def test_the_scan_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import torch\nfrom scissorhands import ScissorhandsCache\n\n\ndef test_x():\n"
                   "    from scissorhands.hf.cache import ScissorhandsLayer\n    import transformers\n")
    assert forbidden_imports(bad) == ["test_bad.py:2: scissorhands", "test_bad.py:6: scissorhands.hf.cache",
                                      "test_bad.py:7: transformers"]
    bad.write_text("import scissorhands\nfrom conftest import tiny_model\nfrom test_scoring import BASE\n"
                   "from scissorhands.core.settings.config import CacheSettings\n")
    assert forbidden_imports(bad) == ["test_bad.py:1: scissorhands", "test_bad.py:2: conftest",
                                      "test_bad.py:3: test_scoring"]


def run_blocked(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", BLOCKER, "-p", "no:cacheprovider", "--confcutdir", str(CORE_TESTS),
                           "-q", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_core_tests_collect_and_run_with_transformers_the_adapters_and_the_tools_blocked():
    """Every file of tests/core collects (an import error in any would fail the run), and three of its tests run."""
    quick = ("test_chunking_does_not_change_the_result or test_make_store_picks_dense_for_16_and_none or "
             "test_stores_are_checked_when_made_and_named")
    result = run_blocked("tests/core", "-k", quick)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0 and re.search(r"\b3 passed", result.stdout), output


def test_the_blocked_run_fails_on_a_blocked_import(tmp_path):
    """The blocker is real: a core-style test that imports the adapter fails to collect under it."""
    folder = tmp_path / "core"
    folder.mkdir()
    (folder / "test_adapter.py").write_text("import scissorhands.hf\n\n\ndef test_x():\n    pass\n")
    result = subprocess.run([sys.executable, "-c", BLOCKER, "-p", "no:cacheprovider", "--confcutdir", str(folder),
                             "--rootdir", str(folder), "-q", "--collect-only", str(folder)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "scissorhands.hf: blocked" in result.stdout, result.stdout[-3000:]
