"""Building and loading the plugin's compiled operator before serving, with one line for each way it can fail.

``torch.utils.cpp_extension`` builds an extension in a folder of its own
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions/py<version>_cpu``,
then the extension's name) and guards the build with an empty file, ``lock``,
on which every other loader waits with no timeout. A build killed midway leaves
that file behind, and every later load then waits forever. :func:`load` keeps
torch's build and its folder, and adds:

* a module already built is imported from its file, so a folder built ahead
  (``scissorhands build``, a cluster image) may be read-only where it serves;
* builds are serialised by an advisory lock (``flock``) that the kernel releases
  when its holder dies, so a ``lock`` found while holding it was left by a killed
  build, unless a live process still has it open or works in the folder (its
  compiler): that build is waited for, at most ``wait_s`` seconds;
* a stale ``lock`` is removed and the removal logged, or, where it cannot be
  removed, named with the command that removes it;
* what is missing is named: no C++ compiler (``$CXX``, by default ``c++``), no
  ninja, a folder that cannot be written (with ``TORCH_EXTENSIONS_DIR``), and a
  compiler's own error by its first line.

Every failure is a :class:`BuildError` of one line. Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger("vllm.scissorhands")  # under vLLM's logger, as the plugin's own lines

#: How long a load waits for another process's build of the same operator (a build takes about a minute).
WAIT_S = 600.0
SUBJECT = "the paged attention operator"


class BuildError(RuntimeError):
    """The operator cannot be built or loaded here: one line saying what failed and what to do."""


def extensions_root() -> Path:
    """Where torch keeps its extension builds: ``TORCH_EXTENSIONS_DIR``, or torch's default per Python and
    accelerator (``~/.cache/torch_extensions/py311_cpu``), as ``torch.utils.cpp_extension`` names it."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = ("rocm" + torch.version.hip.replace(".", "") if torch.version.hip
                   else "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def module_file(name: str) -> Path:
    """The built module's file (it may not exist yet)."""
    return extensions_root() / name / f"{name}.so"


def load(name: str, source: str, functions: list[str], cflags: list[str], ldflags: list[str],
         wait_s: float = WAIT_S):
    """The extension ``name`` built from ``source``: imported if built, else built now (one process at a time).

    Raises :class:`BuildError` (one line) when it cannot be."""
    folder = extensions_root() / name
    deadline = time.monotonic() + wait_s
    _wait_for_builders(folder, deadline)
    module = _import(folder, name, functions)
    if module is not None:
        if (folder / "lock").exists():  # left by a killed build (no live builder): harmless here, a hang for torch's
            _clear_if_stale(folder)
        return module
    compiler = _check_tools()
    _check_writable(folder)
    with _exclusive(folder, deadline):
        _wait_for_builders(folder, deadline)  # a builder that takes no flock (an older release, torch's own loader)
        module = _import(folder, name, functions)  # built by the process whose flock was waited for
        if module is not None:
            return module
        _clear_stale_lock(folder)
        # A file left by a killed link would look up to date to ninja: build from the sources again.
        with contextlib.suppress(OSError):
            (folder / f"{name}.so").unlink()
        logger.info("scissorhands: building %s for this machine (about a minute): %s", SUBJECT, folder)
        from torch.utils import cpp_extension

        try:
            return cpp_extension.load_inline(name=name, cpp_sources=source, functions=functions, extra_cflags=cflags,
                                             extra_ldflags=ldflags, build_directory=str(folder), verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = next((x.strip() for x in lines if "error" in x.lower() and "Error building" not in x), lines[0])
            raise BuildError(f"{SUBJECT} cannot be built by {compiler} (torch.utils.cpp_extension): "
                             f"{first}") from None


def _import(folder: Path, name: str, functions: list[str]):
    """The module built in ``folder``, or None (never built, or a file that does not load: built again)."""
    path = folder / f"{name}.so"
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module if all(hasattr(module, f) for f in functions) else None


def _check_tools() -> str:
    """The C++ compiler torch will call; a :class:`BuildError` naming what is missing."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available

    compiler = get_cxx_compiler()  # $CXX, by default c++
    if shutil.which(compiler) is None:
        where = "$CXX" if os.environ.get("CXX") else "the default; set CXX to use another"
        raise BuildError(f"{SUBJECT} cannot be built: no C++ compiler: {compiler!r} ({where}) is not on PATH; "
                         "install one (g++) or build it ahead with `scissorhands build` on a machine with the "
                         "same CPU and torch")
    if not is_ninja_available():
        raise BuildError(f"{SUBJECT} cannot be built: torch builds extensions with ninja, which is not on PATH; "
                         "pip install ninja")
    return compiler


def _check_writable(folder: Path) -> None:
    """Make ``folder`` and write a file in it; a :class:`BuildError` naming the folder otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        how = ("TORCH_EXTENSIONS_DIR" if os.environ.get("TORCH_EXTENSIONS_DIR")
               else "torch's default; set TORCH_EXTENSIONS_DIR to a writable folder")
        raise BuildError(f"{SUBJECT} cannot be built: the extension cache folder {str(extensions_root())!r} "
                         f"({how}) cannot be written: {e.strerror or type(e).__name__}; set TORCH_EXTENSIONS_DIR "
                         "to a writable folder, or build it there ahead with `scissorhands build`") from None


@contextlib.contextmanager
def _exclusive(folder: Path, deadline: float) -> Iterator[None]:
    """Hold the folder's build flock (released by the kernel if this process dies), waiting until ``deadline``."""
    path = folder / "build.flock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"{SUBJECT}: another process has been building it in {str(folder)!r} for too "
                                     f"long (its flock {str(path)!r} is held); end that process, then start "
                                     "again") from None
                if not said:
                    logger.info("scissorhands: waiting for another process's build of %s in %s", SUBJECT, folder)
                    said = True
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the flock


def builders(folder: Path) -> list[int] | None:
    """Processes (other than this one) that hold the folder's torch ``lock`` open or run in the folder (a build
    and its compiler), or None where that cannot be told (no ``/proc``)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    here = os.path.realpath(folder)  # what /proc's links name
    lock = os.path.join(here, "lock")
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if os.readlink(entry / "cwd") == here:
                found.append(int(entry.name))
                continue
            if any(os.readlink(fd) == lock for fd in (entry / "fd").iterdir()):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _wait_for_builders(folder: Path, deadline: float) -> None:
    """While torch's ``lock`` exists and a live process builds in the folder, wait (until ``deadline``)."""
    lock = folder / "lock"
    said = False
    while lock.exists():
        pids = builders(folder)
        if pids == []:
            return  # stale: its builder is gone (cleared by the next build)
        if time.monotonic() > deadline:
            who = f"process {', '.join(map(str, pids))}" if pids else "a process this one cannot see"
            raise BuildError(f"{SUBJECT}: waited for the build in {str(folder)!r} by {who}; if it is stuck, end it "
                             f"and remove its lock: rm {lock}")
        if not said:
            logger.info("scissorhands: waiting for the build of %s in %s (process %s)", SUBJECT, folder, pids)
            said = True
        time.sleep(0.2)


def _clear_if_stale(folder: Path) -> None:
    """Remove a stale ``lock`` beside a module that loads, if the folder can be written; else say where it is."""
    try:
        with _exclusive(folder, time.monotonic() + 5.0):
            if builders(folder) == []:
                _clear_stale_lock(folder)
    except (BuildError, OSError):
        logger.warning("scissorhands: a stale lock left by a killed build remains (torch's own loader would wait on "
                       "it): rm %s", folder / "lock")


def _clear_stale_lock(folder: Path) -> None:
    """Remove torch's ``lock`` left by a killed build (its builder gone), saying so; one line if it cannot be."""
    lock = folder / "lock"
    if not lock.exists():
        return
    try:
        lock.unlink()
    except FileNotFoundError:
        return
    except OSError as e:
        raise BuildError(f"{SUBJECT} cannot be built: a stale lock left by a killed build, {str(lock)!r}, cannot "
                         f"be removed ({e.strerror}); remove it: rm {lock}") from None
    logger.warning("scissorhands: removed a stale lock left by a killed build of %s: %s", SUBJECT, lock)
