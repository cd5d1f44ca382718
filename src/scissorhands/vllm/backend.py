"""vLLM's CPU attention, with each budgeted layer presented as a sliding window and attended by the plugin.

Registered over ``CPU_ATTN`` by the plugin (:mod:`.plugin`). With the plugin
off (no ``scissorhands`` settings), every method here is the parent's, so
vLLM behaves exactly as without it.
"""

from __future__ import annotations

import logging
import re

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from . import kernels, worker
from .paged import PagedLayer, Planner
from .settings import PluginSettings, from_vllm

logger = logging.getLogger("vllm.scissorhands")  # under vLLM's logger, so its lines show with vLLM's

#: This engine's settings, read when its attention layers are built (the spec hook that follows has no config).
ACTIVE: dict[str, PluginSettings | None] = {}


def _settings() -> PluginSettings | None:
    ACTIVE["settings"] = from_vllm(get_current_vllm_config().additional_config)
    return ACTIVE["settings"]


class ScissorhandsImpl(CPUAttentionBackendImpl):
    """The CPU kernel, then the core's bookkeeping for the step (prompts' outputs are the core's exact ones)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = _settings()
        self.paged: PagedLayer | None = None
        if self.settings is not None and self.sliding_window in (-1, None):
            self.sliding_window = self.settings.budget  # vLLM's block manager frees what falls behind it
            if self.alibi_slopes is not None or getattr(self, "sinks", None) is not None:
                raise ValueError("model: the scissorhands plugin attends with plain softmax attention; this model's "
                                 "ALiBi slopes or attention sinks are not supported")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.settings is None or attn_metadata is None or self.sliding_window != self.settings.budget:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        isa = getattr(layer, "isa", "vec")
        if isa not in kernels.LAYOUTS:  # checked in the warm-up run too, so an engine that cannot serve never starts
            raise ValueError(f"scissorhands: vLLM's CPU attention kernel here is {isa!r}, whose K/V layout the plugin "
                             f"cannot read (it reads {', '.join(kernels.LAYOUTS)})")
        if not worker.in_step():  # a warm-up or profiling run: no requests
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self.paged is None:
            match = re.search(r"layers\.(\d+)\.", getattr(layer, "layer_name", ""))
            self.paged = PagedLayer(self.settings, int(match.group(1)) if match else 0, self.num_heads,
                                    self.num_kv_heads, self.head_size, self.scale, self.logits_soft_cap or None,
                                    layout=isa, fp8=self.kv_cache_dtype if self.kv_cache_dtype in kernels.FP8 else None,
                                    k_scale=getattr(layer, "_k_scale_float", 1.0),
                                    v_scale=getattr(layer, "_v_scale_float", 1.0))
            self.paged.defer_rounds = True  # the worker runs every layer's rounds after the forward
            worker.LAYERS.append(self.paged)
            if "planner" not in worker.PLANNER:
                worker.PLANNER["planner"] = Planner(self.settings)
        n = attn_metadata.num_actual_tokens
        md = attn_metadata
        planner = worker.PLANNER["planner"]
        plan = planner.cached(worker.step_id())  # the step's first layer makes it; the others reuse it
        if plan is None:
            request_ids = worker.request_ids() or []
            plan = planner.for_step(worker.step_id(), request_ids[: md.seq_lens.shape[0]], md.query_start_loc,
                                    md.seq_lens, md.block_table, md.slot_mapping, kv_cache.shape[2])
        # vLLM's cache update has written the step's K/V; the layer attends every row itself (vLLM's kernel is
        # not called: its windowed prompt outputs would be replaced and its decode outputs recomputed).
        self.paged.step(plan, query[:n].view(n, self.num_heads, -1), key[:n].view(n, self.num_kv_heads, -1),
                        value[:n].view(n, self.num_kv_heads, -1), kv_cache, output[:n].view(n, self.num_heads, -1))
        return output


class ScissorhandsBackend(CPUAttentionBackend):
    """``CPU_ATTN``, whose full-attention layers become windows of the budget when the plugin is on."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ScissorhandsImpl

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        settings = ACTIVE.get("settings")
        if settings is None or type(spec) is not FullAttentionSpec:
            return spec
        # vLLM's block manager frees what falls behind the window: the blocks of evicted tokens go back.
        return SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                 head_size=spec.head_size, head_size_v=spec.head_size_v, dtype=spec.dtype,
                                 kv_quant_mode=spec.kv_quant_mode, sliding_window=settings.budget)


__all__ = ["ScissorhandsBackend", "ScissorhandsImpl"]
