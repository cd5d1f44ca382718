"""The command line's run: parse, dispatch to the subcommand's module, and end every failure in one line (a
``ValueError`` naming the option, an ``OSError`` naming the option whose path it concerns, Ctrl-C and SIGTERM)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import declared

from . import _interrupted_while_importing
from .checks import check_model_args
from .parser import build_parser, cache_settings

_PATH_OPTIONS = ("out", "prompt_file", "data", "text", "from_json", "schedule", "model")


def _os_error_message(args, exc: OSError) -> str:
    """``<option>: <reason>: '<path>'`` for an OSError, naming the option whose path it concerns."""
    filename = exc.filename
    reason = exc.strerror or type(exc).__name__
    name = "file"
    if filename is not None:
        target = os.path.abspath(os.fspath(filename))
        for option in _PATH_OPTIONS:
            value = getattr(args, option, None)
            if not isinstance(value, (str, Path)) or not str(value):
                continue
            root = os.path.abspath(os.path.expanduser(os.fspath(value)))
            if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
                name = option.replace("_", "-")
                break
        return f"{name}: {reason}: {os.fspath(filename)!r}"
    return f"{name}: {reason}"


def interrupt_in_finalizers() -> None:
    """Keep a Ctrl-C that lands inside an object's finalizer (``__del__``, where Python only prints it as
    "Exception ignored" with a traceback and carries on): deliver it again a millisecond later, outside the
    finalizer, so that it ends the run where any other Ctrl-C would, with the same one line (and a partial
    result saved where the command saves one). Installed once per process."""

    previous = sys.unraisablehook
    if getattr(previous, "scissorhands", False):
        return

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
        elif hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            # Any Python run here would raise it inside the hook and lose it again; a timer raises it later.
            before = signal.getsignal(signal.SIGALRM)

            def again(signum, frame) -> None:
                signal.signal(signal.SIGALRM, before)
                raise KeyboardInterrupt

            signal.signal(signal.SIGALRM, again)
            signal.setitimer(signal.ITIMER_REAL, 0.001)
        else:  # no timers, or a finalizer on another thread: end the run here, in the same one line
            say("interrupted", 130)
            sys.stderr.flush()
            os._exit(130)

    hook.scissorhands = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``kill``, a container stopping), raised where the run is, so that it ends as a
    Ctrl-C does: files left consistent, one line."""


def _terminate(signum, frame) -> None:
    raise Terminated


def _terminated(args) -> str:
    """The one line a terminated run ends with: where its results are, and that the same command resumes."""
    if args.command == "eval":  # every finished row is written whole as it finishes (tools/eval/runner.py)
        return (f"terminated; the rows finished are in {args.out} (a row cut off keeps its scored items), and the "
                "same command resumes from them")
    return "terminated"  # bench has said where the parts it finished are


def _import_heavy(command: str) -> None:
    """torch (and transformers, for every command but ``build``, which loads no model), imported while a Ctrl-C
    still ends the process at once: one landing inside their C++ start-up, raised as KeyboardInterrupt through a
    pybind11 call, would abort the process ("terminate called ...") instead of ending it in one line."""
    import torch  # noqa: F401

    if command != "build":
        import transformers  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    exits_at_once = signal.getsignal(signal.SIGINT) is _interrupted_while_importing
    interrupt_in_finalizers()
    parser = build_parser()
    args = parser.parse_args(argv)
    if exits_at_once:  # python -m scissorhands.tools.cli: from here on a Ctrl-C is raised, so work is kept
        _import_heavy(args.command)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    on_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if on_main_thread else None
    try:
        return _run(parser, args)
    except Terminated:
        return say(_terminated(args), 143)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, before)


def _run(parser, args) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not args.verbose:  # hub retries are reported once, as the one-line model error
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if args.command == "generate":
            from .generate import read_prompt
            from .generate import run as run_generate

            return run_generate(args, read_prompt(args))
        if args.command == "eval":
            from .eval import run as run_eval

            return run_eval(args)
        if args.command == "analyze":
            from ..analysis.cli import run as run_analyze

            return run_analyze(args)
        if args.command == "bench":
            from ..bench_cli import run as run_bench

            return run_bench(args, cache_settings(args), check_model_args)
        if args.command == "calibrate":
            from .calibrate import run as run_calibrate

            return run_calibrate(args)
        if args.command == "build":
            from ..build_cli import run as run_build

            return run_build(args)
        if args.command == "heads":
            from ..heads_cli import run as run_heads

            return run_heads(args, check_model_args)
        if args.command == "demo":
            from ..generation import demo_chat
            from .generate import run as run_generate

            return run_generate(args, demo_chat)
    except ValueError as e:  # includes ModelLoadError; messages start with the parameter's name
        return say(f"error: {in_flag_words(first_line(e))}", 2)
    except OSError as e:  # a file or folder that could not be read or written
        return say(f"error: {_os_error_message(args, e)}", 2)
    except Terminated:
        raise  # main() says where the results are
    except KeyboardInterrupt:
        return say("interrupted", 130)
    parser.error(f"unknown command {args.command!r}")
    return 2


def in_flag_words(message: str) -> str:
    """A library message in the command line's words: a setting's name as its flag (``kv_bits: ...`` ->
    ``kv-bits: ...``, ``kv_bits=None`` -> ``--kv-bits none``), and ``None`` as the ``none`` the flags take."""
    import re

    fields = {n for n, _, _ in declared(CacheSettings)}
    name, sep, rest = message.partition(": ")
    if not (sep and name in fields):
        return message
    rest = rest.replace(" or None,", " or none,").replace("None =", "none =")
    for field in sorted((f for f in fields if "_" in f), key=len, reverse=True):
        flag = "--" + field.replace("_", "-")
        rest = re.sub(rf"\b{field}=None\b", f"{flag} none", rest)
        rest = re.sub(rf"\b{field}=", f"{flag} ", rest)
        rest = re.sub(rf"(?<![-\w]){field}\b", flag, rest)
    return f"{name.replace('_', '-')}: {rest}"


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (its type if there is none)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def say(message: str, code: int) -> int:
    """The command line's one line on stderr; returns the exit code (shared with the lm-eval entry point).

    A progress bar still on screen (an interrupt or error mid-run) is closed
    first, so the line starts on a line of its own.
    """
    tqdm = sys.modules.get("tqdm")
    bars = list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ())
    for bar in bars:
        bar.close()
    if bars:
        sys.stderr.write("\n")
    print(f"scissorhands: {message}", file=sys.stderr)
    return code
