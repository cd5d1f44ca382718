"""Each pytest-xdist worker takes its share of the machine's cores.

The README's test command runs the suite in parallel (``-n auto``: one worker per core). torch would give every
worker a thread per core, so two workers on two cores would run four busy threads and spin against each other;
each worker (and what it starts: the command line's processes, vLLM's engine) is given ``cores // workers``
threads instead, and vLLM's engine, which binds its threads to cores, the worker's own cores
(``VLLM_CPU_OMP_THREADS_BIND``), where it would otherwise bind every worker's engine to the same ones.

Float results may then differ in their last bits from a run with another thread count: the pinned numbers hold
bitwise only on the platform and thread count that made them (``test_pinned_numbers.py``).
"""

import os


def share_cores() -> None:
    """Set this worker's threads for torch and for the processes it starts; nothing outside xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers < 2:
        return
    cores = sorted(os.sched_getaffinity(0))
    threads = max(1, len(cores) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    mine = [cores[(worker * threads + i) % len(cores)] for i in range(threads)]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    import torch

    torch.set_num_threads(threads)
