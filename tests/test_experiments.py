"""The experiments folder stays runnable: every script answers --help, its configs parse, the docs' paths exist."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("*.py"))
CONFIGS = sorted((EXPERIMENTS / "configs").glob("*.json"))
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_the_folder_has_scripts_and_configs():
    assert SCRIPTS
    assert CONFIGS
    assert not list(EXPERIMENTS.glob("*.json")), "sweep configs go in experiments/configs/"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_answers_help(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200] + proc.stderr[-2000:]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses(config):
    json.loads(config.read_text())


def _mentioned(pattern):
    found = set()
    for doc in DOCS:
        if doc.exists():
            found.update(re.findall(pattern, doc.read_text(encoding="utf-8")))
    return sorted(found)


def test_config_paths_in_the_docs_exist():
    paths = _mentioned(r"experiments/configs/[\w.-]+\.json")
    assert paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, missing


def test_script_paths_in_the_docs_exist():
    paths = _mentioned(r"experiments/\w+\.py")
    assert paths
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, missing
