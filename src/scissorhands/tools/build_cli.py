"""``scissorhands build``: the vLLM plugin's compiled operator built ahead of serving (a cluster image).

The operator is built for the CPU and the torch it runs with (``-march=native``),
in torch's extension folder (``TORCH_EXTENSIONS_DIR``); run this in the serving
environment, on the CPU type it serves on, and a server then loads the module at
start-up instead of building it. It needs torch alone, not vLLM.
"""

from __future__ import annotations

import sys
import time


def add_parser(subparsers) -> None:
    """Add the ``build`` subcommand (no options: what is built follows from the machine and torch)."""
    subparsers.add_parser("build", allow_abbrev=False,
                          help="build the vLLM plugin's compiled operator for this CPU and torch ahead of serving (a "
                          "cluster image): it lands in TORCH_EXTENSIONS_DIR")


def run(args) -> int:
    """Build or load the operator; one line saying where it lies. A failure is the command line's one-line error."""
    import torch

    from scissorhands.vllm import kernels
    from scissorhands.vllm.build import BuildError

    path = kernels.operator_file()
    was_built = path.is_file()
    start = time.monotonic()
    try:
        kernels.build()
    except BuildError as e:
        raise ValueError(str(e)) from None  # the command line's one line, exit code 2
    how = "already built" if was_built else f"built in {time.monotonic() - start:.0f} s"
    print(f"the paged attention operator for this CPU and torch {torch.__version__} ({how}): {path}", file=sys.stderr)
    return 0
