"""Checks on the files and folders a command will write, made before any slow work starts."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
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
        raise ValueError(f"{name}: cannot write in {str(probe_dir)!r} ({_why_not_writable(probe_dir, e)})") from None
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


def _why_not_writable(folder: Path, error: OSError) -> str:
    """A reason a user can act on; the system's own words for a folder that exists can mislead
    ("No such file or directory" for a file created in /proc)."""
    import errno

    if error.errno == errno.EROFS:
        return "the filesystem is mounted read-only"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "permission denied: the folder is not writable for this user, or is immutable"
    if error.errno in (errno.ENOENT, errno.EINVAL, errno.EOPNOTSUPP) and folder.is_dir():
        return ("this folder is on a filesystem that does not hold ordinary files (such as /proc or /sys); "
                "give a folder on a disk")
    if error.errno == errno.ENOSPC:
        return "no space left on the device"
    return error.strerror or str(error)


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file, existing or not (``~`` expanded, links and ``..`` resolved)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)  # also hard links and case-insensitive names
    return pa.resolve() == pb.resolve()


def check_apart(outputs: dict[str, list[str | Path]], inputs: dict[str, object]) -> None:
    """Refuse, before any work, an output that would overwrite an input or another output of the same run.

    Parameters
    ----------
    outputs : dict
        Option name (as the user typed it, without ``--``) to the paths written under it.
    inputs : dict
        Option name to the value given; values that are not paths (``None``, a
        task name, a list of budgets) are skipped, so callers may pass options
        as they are.

    Raises
    ------
    ValueError
        ``"<output option>: '<path>' would overwrite the --<input option> file '<path>'"``, or
        ``"... is also written by --<other option>"``.
    """
    files = [(name, p) for name, paths in outputs.items() for p in paths]
    for name, out in files:
        for option, given in inputs.items():
            if isinstance(given, (str, Path)) and str(given) and Path(given).expanduser().is_file() \
                    and same_path(given, out):
                raise ValueError(f"{name}: {str(out)!r} would overwrite the --{option} file {str(given)!r}")
    for i, (name, out) in enumerate(files):
        for other, out2 in files[i + 1:]:
            if same_path(out, out2):
                raise ValueError(f"{name}: {str(out)!r} is also written by --{other}")


@contextlib.contextmanager
def exclusive(folder: Path, name: str) -> Iterator[None]:
    """Hold ``folder`` for one run: a second run into it at the same time is refused, not interleaved.

    Two runs appending to one results file would each compute and write every
    row. The hold is an advisory ``flock`` on ``folder/.scissorhands.lock``,
    released when the run ends or its process dies; the empty file stays.
    """
    import fcntl

    fd = os.open(folder / ".scissorhands.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{name}: {str(folder)!r} is in use by another run at this moment; wait for it to "
                             "finish, or give another folder") from None
        yield
    finally:
        os.close(fd)


def check_same_run(path: Path, records: list[dict], wanted: dict[str, object]) -> None:
    """Refuse to add to ``path`` rows of a run other than the one its ``records`` came from.

    ``wanted`` maps a record field (``seq_len``) to this run's value; the option
    that sets it is the field with dashes (``--seq-len``). A field a record
    lacks (written before it was recorded) is not compared. Lists and tuples
    compare alike, as JSON keeps either as a list.

    Raises
    ------
    SystemExit
        One line: ``"--<option>: <path> holds a run with <field> X, not Y; ..."``.
    """
    for rec in records:
        for field, value in wanted.items():
            mine = list(value) if isinstance(value, tuple) else value
            if field in rec and rec[field] != mine:
                flag = "--" + field.replace("_", "-")
                raise SystemExit(f"{flag}: {path} holds a run with {field} {rec[field]!r}, not {mine!r}; "
                                 "pass the same or choose another --out")
