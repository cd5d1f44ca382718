"""Build the vLLM adapter's operators for another x86 level than this machine's and run their tests on that build.

The plugin builds with ``-march=native`` on the serving machine; this checks on one machine that the same source
is right where the compiler has less (``x86-64-v3``: AVX2 and FMA, no AVX-512; ``x86-64``: SSE2 only). The build
has a name of its own (the flags are part of it), so the native one is untouched.

    python experiments/vllm_operator_march.py x86-64-v3
    python experiments/vllm_operator_march.py x86-64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests" / "vllm"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("march", help="the x86 level to build for (x86-64-v3, x86-64, ...)")
    args = p.parse_args(argv)
    import pytest

    from scissorhands.vllm import kernels

    kernels._CFLAGS[:] = [f"-march={args.march}" if f == "-march=native" else f for f in kernels._CFLAGS]
    kernels._OPS.clear()
    print(f"built for -march={args.march}: {kernels.build().__file__}", flush=True)
    return pytest.main(["-q", "-p", "no:cacheprovider", str(TESTS / "test_operators.py"),
                        str(TESTS / "test_paged_layer.py"), "-k", "operator or decode or rounds"])


if __name__ == "__main__":
    sys.exit(main())
