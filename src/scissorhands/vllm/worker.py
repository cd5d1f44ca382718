"""The worker side's view of a step: which request each batch row is, and which requests finished.

vLLM's attention metadata carries no request ids; the plugin's worker (a
``CPUWorker`` whose only change is to publish them) records the model runner
and the step's finished requests, and the layers read them here.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

#: Every budgeted layer of this process (they release finished requests' rows).
LAYERS: list = []
_STEP: dict = {}


def request_ids() -> list[str] | None:
    """The running step's request ids in batch-row order, or None outside a step."""
    runner = _STEP.get("runner")
    return None if runner is None else list(runner.input_batch.req_ids)


class ScissorhandsWorker(CPUWorker):
    """``CPUWorker``, publishing each step's request ids and finished requests to the budgeted layers."""

    def __init__(self, *args, **kwargs):
        LAYERS.clear()  # a new engine in this process: the layers it builds replace any earlier engine's
        super().__init__(*args, **kwargs)

    def execute_model(self, scheduler_output):
        _STEP["runner"] = self.model_runner
        finished = getattr(scheduler_output, "finished_req_ids", None) or ()
        for layer in LAYERS:
            layer.release(finished)
        try:
            return super().execute_model(scheduler_output)
        finally:
            _STEP.pop("runner", None)
