"""How a refusal reaches the user: one line, from the front end or from an engine process.

In the front end a refusal ends start-up at once (:func:`refuse`: ``LLM(...)`` raises it, a server prints it and
exits with code 2). What only an engine process can see (the worker, once the layers exist) travels through a
file the front end names before its engine starts (:func:`await_refusals`, through ``SCISSORHANDS_VLLM_REFUSAL``,
which the engine's processes inherit): the worker leaves its line there and ends quietly
(:func:`refuse_in_engine`), vLLM's engine core logs no traceback for it (:func:`quiet_failed_start`), and the
front end says the line in place of vLLM's failed start. :func:`refusal_in` takes the plugin's refusal out of the
validation report vLLM wraps a config step's error in.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import tempfile
import uuid
from typing import NoReturn

from .settings import Refusal

#: Set by the front end to ``<its pid>:<file>``: where its engine's processes leave a refusal for it.
RECORD = "SCISSORHANDS_VLLM_REFUSAL"

logger = logging.getLogger("vllm.scissorhands")  # under vLLM's logger, so its lines show with vLLM's


def refuse(error: Exception, server: bool) -> NoReturn:
    """End start-up with ``error``'s one line: a server prints it and exits with code 2 (its launcher would print a
    traceback around it); ``LLM(...)`` and other Python callers get the exception itself."""
    if server:
        sys.stderr.write(f"scissorhands: error: {error}\n")
        raise SystemExit(2) from None
    raise error from None


def await_refusals(server: bool = True) -> None:
    """In the front end, before its engine starts: name a file for the engine's processes to leave a refusal in
    (:func:`refuse_in_engine`). ``LLM(...)`` turns a failed start after one was left into the refusal itself (the
    patched ``LLMEngine.from_engine_args``); a server, should it end with an exception after one was left, prints
    that line and exits with code 2 (Python's ``sys.excepthook``; any other exception goes to the hook before)."""
    here = os.environ.get(RECORD, "")
    if here.split(":", 1)[0] == str(os.getpid()):  # named already (a second engine config in this process)
        return
    path = os.path.join(tempfile.gettempdir(), f"scissorhands-refusal-{os.getpid()}-{uuid.uuid4().hex}")
    os.environ[RECORD] = f"{os.getpid()}:{path}"  # inherited by the engine's processes, started after this
    atexit.register(_forget, path)
    if not server:
        return
    previous = sys.excepthook

    def excepthook(kind, value, traceback) -> None:
        line = _recorded(path)
        if line is None and isinstance(value, Refusal):  # an engine in this process raised it (it left no file)
            line = str(value)
        if line is None:
            previous(kind, value, traceback)
            return
        # vLLM's report of the failed engine start ("Engine core initialization failed. See root cause above.")
        # is this one line's consequence. The interpreter would exit with code 1 after this hook: exit now, with
        # the code of every other refusal, once the log is flushed and the file removed.
        sys.stderr.write(f"scissorhands: error: {line}\n")
        sys.stderr.flush()
        _forget(path)
        logging.shutdown()
        os._exit(2)

    sys.excepthook = excepthook


def refuse_in_engine(refusal: Exception) -> NoReturn:
    """End start-up in an engine process with ``refusal`` (the worker's, once the layers exist). Its line is left
    in the front end's file (:func:`await_refusals`) first; a process of its own (the engine core or a worker,
    not the front end itself) then logs it and ends with ``SystemExit(2)``, which vLLM takes as a shutdown, with
    no traceback of its own, and the front end says it. An engine in the front end's process raises it and leaves
    no file (the front end sees the exception itself; a file would outlive the request until the process ends)."""
    front, _, path = os.environ.get(RECORD, "").partition(":")
    if path and front != str(os.getpid()):
        with open(path, "w", encoding="utf-8") as f:
            f.write(str(refusal))
        logger.error("scissorhands: %s", refusal)
        raise SystemExit(2) from None
    raise refusal


class _FailedStartOfARefusal(logging.Filter):
    """Drops the engine core's "EngineCore failed to start." record (its traceback is the worker's end) once a
    refusal was left: the front end says the refusal's one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("EngineCore failed to start"):
            return True
        return _recorded(_record_path()) is None


def quiet_failed_start() -> None:
    """In every process: vLLM's engine core logs no traceback for a start the plugin refused (a logging filter
    on its logger; any other failure is logged as vLLM logs it)."""
    engine_logger = logging.getLogger("vllm.v1.engine.core")
    if not any(isinstance(f, _FailedStartOfARefusal) for f in engine_logger.filters):
        engine_logger.addFilter(_FailedStartOfARefusal())


def _record_path() -> str:
    """The file this process's front end named for a refusal (empty: none named)."""
    return os.environ.get(RECORD, "").partition(":")[2]


def _recorded(path: str) -> str | None:
    """The refusal an engine process left in ``path``, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def take_recorded() -> str | None:
    """The refusal an engine process left for this front end (:func:`refuse_in_engine`), its file then removed; None
    when none was left."""
    line = _recorded(_record_path())
    if line is not None:
        _forget(_record_path())
    return line


def _forget(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def refusal_in(error: BaseException) -> Refusal | None:
    """The plugin's :class:`~.settings.Refusal` inside vLLM's validation report (pydantic keeps the exception a
    validator raised in each error's context), or None."""
    if isinstance(error, Refusal):
        return error
    try:
        details = error.errors()  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        details = []
    for detail in details:
        found = (detail.get("ctx") or {}).get("error")
        if isinstance(found, Refusal):
            return found
    cause = error.__cause__ or error.__context__
    return refusal_in(cause) if cause is not None else None
