"""What a new user meets first: fast help, fast failures, one-line interrupts, readable results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import scissorhands
from scissorhands.core.names import BUILTIN_METHODS

SRC = str(Path(scissorhands.__file__).resolve().parents[1])

# An import hook that refuses the heavy libraries: --help and --version must answer without them.
NO_HEAVY = r"""
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "matplotlib", "tqdm", "gguf", "numpy"):
            raise ImportError(f"{name} imported by --help")
        return None
sys.meta_path.insert(0, Refuse())
from scissorhands.tools.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"], ["demo", "--help"],
                                  ["eval", "--help"], ["analyze", "--help"], ["bench", "--help"],
                                  ["calibrate", "--help"]])
def test_help_and_version_import_no_heavy_library(argv):
    proc = subprocess.run([sys.executable, "-c", NO_HEAVY, *argv], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "imported by --help" not in proc.stderr
    assert proc.stdout.strip()


def test_the_help_lists_every_builtin_method_in_registry_order():
    from scissorhands.core.methods import METHODS

    assert BUILTIN_METHODS == tuple(n for n in METHODS if METHODS[n].__module__.startswith("scissorhands."))
