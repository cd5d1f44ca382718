"""The ``vllm.general_plugins`` entry point: registers the attention backend and prepares the engine config.

vLLM calls :func:`register` in each of its processes. It registers
:class:`~.backend.ScissorhandsBackend` over ``CPU_ATTN`` (a subclass that is
exactly the parent while the plugin is off) and extends the CPU platform's
config step so that, when the ``scissorhands`` settings are present, they are
checked at start-up (a one-line error naming the bad one), the plugin's worker
is used, and prefix caching and chunked prefill are turned off (a prompt must
be held whole and attended once; a shared prefix block cannot be evicted for
one request alone), saying so in the log.

Both start-up steps extend a vLLM method in place, since vLLM 0.32 has no hook
for either: a general plugin gets no config step, and a platform plugin (a
``CpuPlatform`` subclass) is skipped when ``VLLM_TARGET_DEVICE=cpu``, where vLLM
returns its CPU platform before it loads platform plugins
(``vllm.platforms.resolve_current_platform_cls_qualname``).
"""

from __future__ import annotations

import logging
import sys

#: vLLM's usage contexts of its servers: a bad setting there ends the process with one line and exit code 2.
SERVERS = ("OPENAI_API_SERVER", "API_SERVER", "OPENAI_BATCH_RUNNER")

logger = logging.getLogger("vllm.scissorhands")  # under vLLM's logger, so its lines show with vLLM's


def register() -> None:
    """Called by vLLM (entry point ``scissorhands``) in the front end, the engine core and each worker."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if getattr(CpuPlatform.check_and_update_config, "scissorhands", False):  # registered in this process already
        return

    from .settings import from_vllm

    register_backend(AttentionBackendEnum.CPU_ATTN, "scissorhands.vllm.backend.ScissorhandsBackend")
    original = CpuPlatform.check_and_update_config.__func__
    create = EngineArgs.create_engine_config

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        prepare_config(vllm_config)

    def create_engine_config(self, *args, **kwargs):
        # Checked before vLLM builds its config, which would wrap the error in a many-line validation report.
        try:
            from_vllm(self.additional_config)
        except ValueError as e:
            context = kwargs.get("usage_context", args[0] if args else None)
            if getattr(context, "value", context) in SERVERS:  # its launcher would print a traceback around it
                sys.stderr.write(f"scissorhands: error: {e}\n")
                raise SystemExit(2) from None
            raise  # LLM(...) and other Python callers get the ValueError itself
        return create(self, *args, **kwargs)

    check_and_update_config.scissorhands = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    EngineArgs.create_engine_config = create_engine_config


def prepare_config(vllm_config) -> None:
    """With the plugin on: check its settings now, use its worker, hold prompts whole."""
    from . import kernels
    from .settings import from_vllm

    settings = from_vllm(vllm_config.additional_config)  # a bad setting: ValueError("<setting>: ...")
    if settings is None:
        return
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size: the scissorhands plugin is not tested with pipeline parallelism, "
                         f"got {parallel.pipeline_parallel_size}; run with 1 (tensor parallelism shards KV heads, "
                         f"which the plugin evicts per head)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError("speculative_config: the scissorhands plugin cannot serve speculative decoding (draft "
                         "tokens would be scored and evicted before they are accepted); leave it off")
    if vllm_config.cache_config.cache_dtype not in ("auto", None, *kernels.FP8):
        raise ValueError(f"kv_cache_dtype: the scissorhands plugin reads K/V in the model's dtype or vLLM's fp8 "
                         f"({', '.join(kernels.FP8)}), got {vllm_config.cache_config.cache_dtype!r}")
    ours = "scissorhands.vllm.worker.ScissorhandsWorker"  # the config is prepared again in the engine's process
    if parallel.worker_cls not in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", ours):
        raise ValueError(f"worker_cls: the scissorhands plugin brings its own worker, got {parallel.worker_cls!r}")
    parallel.worker_cls = ours
    cache, scheduler, model = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.model_config
    if cache.enable_prefix_caching or scheduler.enable_chunked_prefill:
        logger.info("scissorhands: prefix caching and chunked prefill are off (each prompt is held whole, "
                    "attended once and evicted to the budget)")
    cache.enable_prefix_caching = False
    scheduler.enable_chunked_prefill = False
    if model is not None:
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model.max_model_len)
    logger.info("scissorhands: method %s, budget %d tokens per layer and KV head", settings.method.name,
                settings.budget)
