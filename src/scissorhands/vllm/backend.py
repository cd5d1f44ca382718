"""vLLM's CPU attention, with each budgeted layer presented as a sliding window and attended by the plugin.

Registered over ``CPU_ATTN`` by the plugin (:mod:`.plugin`). A layer becomes
budgeted when the plugin's worker attaches its state (:mod:`.worker`); with
the plugin off (no ``scissorhands`` settings) nothing is attached and every
method here is the parent's, so vLLM behaves exactly as without it.
"""

from __future__ import annotations

import re

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import kernels
from .paged import PagedLayer
from .settings import Refusal


class ScissorhandsImpl(CPUAttentionBackendImpl):
    """The CPU kernel, or, on a layer the plugin's worker attached, the layer's budgeted step."""

    engine = None  # the worker's EngineState once attached (:meth:`attach`); None: exactly the parent
    paged: PagedLayer | None = None
    layer_idx = 0

    def attach(self, engine, name: str) -> bool:
        """Make this layer a budgeted one of ``engine`` (the worker's state), if it is a full-attention layer: vLLM
        then sees a sliding window of the budget. False (nothing done) for a layer with a window of its own."""
        if getattr(self, "sliding_window", None) not in (-1, None):
            return False
        if self.alibi_slopes is not None or getattr(self, "sinks", None) is not None:
            raise Refusal("model: the scissorhands plugin attends with plain softmax attention; this model's "
                             "ALiBi slopes or attention sinks are not supported")
        self.engine = engine
        self.sliding_window = engine.settings.budget  # what the metadata builder and vLLM's warm-up kernel see
        match = re.search(r"layers\.(\d+)\.", name)
        self.layer_idx = int(match.group(1)) if match else 0
        return True

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        engine = self.engine
        if engine is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        isa = getattr(layer, "isa", "vec")
        if isa not in kernels.LAYOUTS:  # checked in the warm-up run too, so an engine that cannot serve never starts
            raise ValueError(f"scissorhands: vLLM's CPU attention kernel here is {isa!r}, whose K/V layout the plugin "
                             f"cannot read (it reads {', '.join(kernels.LAYOUTS)})")
        if not engine.in_step:  # a warm-up or profiling run: no requests
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self.paged is None:
            self.paged = PagedLayer(engine.settings, self.layer_idx, self.num_heads, self.num_kv_heads,
                                    self.head_size, self.scale, self.logits_soft_cap or None, layout=isa,
                                    fp8=self.kv_cache_dtype if self.kv_cache_dtype in kernels.FP8 else None,
                                    k_scale=getattr(layer, "_k_scale_float", 1.0),
                                    v_scale=getattr(layer, "_v_scale_float", 1.0))
            self.paged.defer_rounds = True  # the worker runs every layer's rounds after the forward
            engine.layers.append(self.paged)
        n = attn_metadata.num_actual_tokens
        md = attn_metadata
        # The step's first layer makes the plan; the others reuse it.
        plan = engine.planner.cached(engine.step)
        if plan is None:
            plan = engine.planner.for_step(engine.step, engine.request_ids()[: md.seq_lens.shape[0]],
                                           md.query_start_loc, md.seq_lens, md.block_table, md.slot_mapping,
                                           kv_cache.shape[2])
        # vLLM's cache update has written the step's K/V; the layer attends every row itself (vLLM's kernel is
        # not called: its windowed prompt outputs would be replaced and its decode outputs recomputed).
        self.paged.step(plan, query[:n].view(n, self.num_heads, -1), key[:n].view(n, self.num_kv_heads, -1),
                        value[:n].view(n, self.num_kv_heads, -1), kv_cache, output[:n].view(n, self.num_heads, -1))
        return output


class ScissorhandsBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with :class:`ScissorhandsImpl`: exactly the parent on every layer the worker did not attach."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return ScissorhandsImpl


__all__ = ["ScissorhandsBackend", "ScissorhandsImpl"]
