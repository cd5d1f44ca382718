"""Checks on the files and folders a command will write, made before any slow work starts."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_output_folder(path: str | Path, name: str, files: tuple[str, ...] = ()) -> Path:
    """Make sure ``path`` is, or can become, a writable folder, and that ``files`` in it can be written.

    Nothing is created: writability is probed with a temporary file that is
    removed at once, in the folder or, when it does not exist yet, in its
    nearest existing parent. This works where permission bits do not tell
    (a read-only mount, an immutable folder, or a privileged user).

    Parameters
    ----------
    path : str or Path
        The output folder.
    name : str
        The parameter that gave it, for messages (e.g. ``"out"``).
    files : tuple of str
        Names of files the command will write or append to inside the folder.

    Returns
    -------
    Path
        ``path`` with ``~`` expanded.

    Raises
    ------
    ValueError
        ``"<name>: ..."`` when the path is a file, lies under a file, is not
        writable, or one of ``files`` exists and is not a writable file.
    """
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{name}: {str(p)!r} exists and is not a folder")
        probe_dir = p
    else:
        probe_dir = p.parent
        while not probe_dir.exists() and probe_dir != probe_dir.parent:
            probe_dir = probe_dir.parent
        if not probe_dir.is_dir():
            raise ValueError(f"{name}: cannot create {str(p)!r}: {str(probe_dir)!r} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".scissorhands-probe-", dir=probe_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{name}: cannot write in {str(probe_dir)!r} ({e.strerror or e})") from None
    for f in files:
        q = p / f
        if not q.exists() and not q.is_symlink():
            continue
        if not q.is_file():
            raise ValueError(f"{name}: {str(q)!r} exists and is not a file")
        try:
            with q.open("ab"):
                pass
        except OSError as e:
            raise ValueError(f"{name}: cannot write {str(q)!r} ({e.strerror or e})") from None
    return p
