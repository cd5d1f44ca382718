"""The worker side's view of a step: which request each batch row is, which step this is, what finished.

vLLM's attention metadata carries no request ids; the plugin's worker (a
``CPUWorker`` whose only change is to publish them) records the model runner,
numbers the steps (every budgeted layer reuses its step's one plan), hands
finished requests to the planner, and runs the step's rounds for every layer at
once when the model's forward is done.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

#: Every budgeted layer of this process, and the one planner they share.
LAYERS: list = []
PLANNER: dict = {}
_STEP: dict = {"id": 0}


def request_ids() -> list[str] | None:
    """The running step's request ids in batch-row order, or None outside a step."""
    runner = _STEP.get("runner")
    return None if runner is None else list(runner.input_batch.req_ids)


def in_step() -> bool:
    """Whether an engine step is running (warm-up and profiling runs are not steps)."""
    return "runner" in _STEP


def step_id() -> int:
    """A number that changes with every engine step (the plan's key)."""
    return _STEP["id"]


class ScissorhandsWorker(CPUWorker):
    """``CPUWorker``, publishing each step's request ids and finished requests to the budgeted layers."""

    def __init__(self, *args, **kwargs):
        LAYERS.clear()  # a new engine in this process: the layers it builds replace any earlier engine's
        PLANNER.clear()
        super().__init__(*args, **kwargs)

    def execute_model(self, scheduler_output):
        _STEP["runner"] = self.model_runner
        _STEP["id"] += 1
        finished = getattr(scheduler_output, "finished_req_ids", None) or ()
        if "planner" in PLANNER:
            PLANNER["planner"].release(finished)
        try:
            output = super().execute_model(scheduler_output)
            if "planner" in PLANNER:  # the forward is done: every layer's rounds of this step, at once
                PLANNER["planner"].after_step(_STEP["id"], LAYERS)
            return output
        finally:
            _STEP.pop("runner", None)

    def scissorhands_kept(self) -> dict[str, list]:
        """Per live request, per budgeted layer of this worker, the positions each of its KV heads stores
        (ascending): what ``LLM.collective_rpc("scissorhands_kept")`` returns per rank, for tests and audits.
        Under tensor parallelism a rank holds its shard of the KV heads."""
        planner = PLANNER.get("planner")
        if planner is None:
            return {}
        return {rid: [layer.stored_positions(row, seen).tolist() for layer in LAYERS]
                for rid, (row, seen) in planner.where.items()}
