"""The plugin's compiled operator built before serving (``scissorhands.vllm.build``, ``scissorhands build``).

Real builds and real processes, no engine: a module already built is loaded where it lies, a build killed midway
leaves torch's ``lock`` that the next load clears (torch's own loader waits on it forever), a live build is waited
for with a deadline, and a missing compiler or an unwritable extension folder is one line naming it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scissorhands.tools.cli import main
from scissorhands.vllm import build, kernels

TWICE = "int64_t twice(int64_t x) { return 2 * x; }"  # a small extension: one build of it takes ~30 s


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_a_built_operator_is_loaded_where_it_lies_and_a_stale_lock_beside_it_cleared(tmp_path, monkeypatch, caplog):
    """An extension folder holding the built operator (an image built ahead, another environment with the same
    torch) is imported from its file, not built again (the source given here would not compile), and the lock a
    killed build left beside it (no process has it open) is removed and said."""
    ops = kernels.build()
    assert Path(ops.__file__) == kernels.operator_file()
    name = kernels.operator_name()
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(ops.__file__, folder / f"{name}.so")
    (folder / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    module = build.load(name, "this is not C++", ["decode", "prompt"], [], [], wait_s=5)
    assert hasattr(module, "decode") and hasattr(module, "prompt")
    assert not (folder / "lock").exists()
    assert "removed a stale lock" in caplog.text


def test_a_build_killed_midway_is_cleared_and_built_again(tmp_path, monkeypatch, caplog):
    """A process killed while it builds leaves torch's ``lock`` (and its compiler may run on as an orphan): the
    next load waits for any orphan still working in the folder, removes the lock, and returns a working module
    (torch's own loader would wait on the lock forever)."""
    caplog.set_level(logging.INFO, logger="vllm.scissorhands")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "sh_test_twice" / "lock"
    builder = subprocess.Popen([sys.executable, "-c", "import sys; from scissorhands.vllm.build import load; "
                                "load('sh_test_twice', sys.argv[1], ['twice'], [], [])", TWICE])
    try:
        for _ in range(600):
            if lock.exists() or builder.poll() is not None:
                break
            time.sleep(0.1)
        assert lock.exists(), "the build never started"
        time.sleep(0.5)  # its compiler under way
    finally:
        builder.kill()  # SIGKILL: no clean-up runs
        builder.wait()
    assert lock.exists()
    start = time.monotonic()
    module = build.load("sh_test_twice", TWICE, ["twice"], [], [], wait_s=300)
    assert module.twice(21) == 42
    assert not lock.exists()
    assert "removed a stale lock" in caplog.text
    assert time.monotonic() - start < 300


def test_a_live_build_is_waited_for_with_a_deadline_that_names_it(tmp_path, monkeypatch):
    """A lock a live process holds open is a build under way: waited for, but not forever; the line names the
    process and the command that removes the lock."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "sh_test_busy" / "lock"
    lock.parent.mkdir()
    lock.touch()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); print('held', "
                               "flush=True); time.sleep(120)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(build.BuildError) as err:
            build.load("sh_test_busy", TWICE, ["twice"], [], [], wait_s=1.0)
        assert time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait()
    message = _one_line(err)
    assert f"process {holder.pid}" in message and f"rm {lock}" in message, message


def test_no_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(build.BuildError) as err:
        build.load("sh_test_never", TWICE, ["twice"], [], [])
    message = _one_line(err)
    assert "no C++ compiler" in message and "no-such-c++" in message and "$CXX" in message, message


def test_an_unwritable_extension_folder_is_named_with_torch_extensions_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocker / "extensions"))  # under a file: no folder can be made
    with pytest.raises(build.BuildError) as err:
        build.load("sh_test_never", TWICE, ["twice"], [], [])
    message = _one_line(err)
    assert "extension cache folder" in message and str(blocker / "extensions") in message, message
    assert "TORCH_EXTENSIONS_DIR" in message


def test_scissorhands_build_says_where_the_operator_lies_or_what_failed(tmp_path, monkeypatch, capsys):
    assert main(["build"]) == 0
    assert str(kernels.operator_file()) in capsys.readouterr().err
    monkeypatch.setattr(kernels, "_OPS", {})  # this process's loaded operator forgotten: loaded again from the folder
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    assert main(["build"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scissorhands: error: the paged attention operator cannot be "
                                                   "built: no C++ compiler"), lines
