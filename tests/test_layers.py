"""The house's layering: the core knows no framework, and no library module reaches into the tools."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "scissorhands"

BLOCKED = ("transformers", "matplotlib", "tqdm", "gguf", "accelerate", "vllm", "lm_eval")


def test_core_imports_with_frameworks_unavailable():
    """``scissorhands.core`` (every module of it) imports in a process where those packages cannot be imported."""
    code = f"""
import importlib, importlib.abc, pkgutil, sys
BLOCKED = {BLOCKED!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
import scissorhands.core as core
names = [m.name for m in pkgutil.walk_packages(core.__path__, "scissorhands.core.")]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
from scissorhands.core import METHODS, CacheSettings
print(len(names), len(METHODS))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    modules, methods = map(int, out.stdout.split())
    assert modules >= 20 and methods >= 8


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Absolute module names imported by a file (relative imports resolved against its package)."""
    rel = path.relative_to(SRC.parent).with_suffix("").parts
    package = rel[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # ``if TYPE_CHECKING:`` imports never run: names for annotations only
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def test_layers_import_only_downwards():
    """core imports no adapter and no tool; the adapters import no tool and not each other."""
    rules = {"core": ("scissorhands.hf", "scissorhands.vllm", "scissorhands.tools"),
             "hf": ("scissorhands.tools", "scissorhands.vllm"),
             "vllm": ("scissorhands.tools", "scissorhands.hf")}
    bad = []
    for layer, forbidden in rules.items():
        for path in (SRC / layer).rglob("*.py") if (SRC / layer).is_dir() else []:
            for mod in _imports(path):
                if mod.startswith(forbidden):
                    bad.append(f"{path.relative_to(SRC)} imports {mod}")
    assert not bad, bad
    # The rule has teeth: a tool module is found importing the core, the other way round.
    assert any(m.startswith("scissorhands.core") for m in _imports(SRC / "tools" / "cli" / "parser.py"))


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules it imports. ``from . import x`` is an edge to the module ``x``
    where one exists; an edge to one's own parent package is left out (Python runs a parent's ``__init__`` before
    any of its modules, so that edge is in every package and ties nothing); a package's ``__init__`` importing its
    own modules is kept, so a circle through a package's face is seen."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = {m for m in _imports(path) if m in modules and m != name}
        graph[name] = {m for m in found if not name.startswith(m + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def test_no_import_circles():
    """No module of the package imports, directly or through others (a package's ``__init__`` among them),
    itself."""
    graph = _module_graph()
    assert not _circles(graph), _circles(graph)
    # The check has teeth: the circle once found through the stores (settings -> the stores' registry -> a store
    # -> settings) is caught when put back, and so is one inside a single package.
    broken = {k: set(v) for k, v in graph.items()}
    broken["scissorhands.core.stores.tiered"].add("scissorhands.core.settings.config")
    broken["scissorhands.core.settings.config"].add("scissorhands.core.stores.registry")
    circle = {"scissorhands.core.settings.config", "scissorhands.core.stores.registry",
              "scissorhands.core.stores.tiered"}
    assert any(set(found) == circle for found in _circles(broken))  # wherever the search entered it
    assert "scissorhands.core.stores.tiered" in graph["scissorhands.core.stores.registry"]
    assert "scissorhands.core.methods.full" in graph["scissorhands.core.methods"]  # a face's edges are read
