"""The budgeted layer's KV-cache spec and block manager, registered through vLLM's KV-cache spec registry.

A layer the plugin budgets holds at most ``budget`` tokens per request: to
vLLM's block manager it is a window of ``budget`` slots, whose blocks are freed
as they fall behind it (the plugin swaps the victims of each round into the
slots that leave the window next, :mod:`.paged`). vLLM 0.32 lets a plugin bring
its own spec class and the manager that serves it
(``vllm/v1/kv_cache_spec_registry.py``); the plugin's worker reports
:class:`BudgetedWindowSpec` for each budgeted layer, and vLLM's engine builds a
:class:`BudgetedWindowManager` for it. Both are vLLM's sliding window today
(same sizes, same grouping with other sliding windows of the same length, the
same frees); the classes are where a window that depends on the request would
go (``docs/vllm.md``, "A window per request").
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class BudgetedWindowSpec(SlidingWindowSpec):
    """A budgeted full-attention layer: a window of ``sliding_window`` = the budget (tokens per request and KV
    head). vLLM groups it with its own sliding windows (``uniform_type_base_spec``) and sizes it as one."""

    @property
    def budget(self) -> int:
        return self.sliding_window

    @classmethod
    def of(cls, spec: FullAttentionSpec, budget: int) -> BudgetedWindowSpec:
        """The layer's full-attention spec (vLLM's, from the layer) as a window of ``budget``: the same shape,
        dtype and K/V quantisation."""
        return cls(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                   head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                   sliding_window=budget)


class BudgetedWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager over a :class:`BudgetedWindowSpec`: it counts a request's blocks by the
    window, frees each block once it lies behind it, and admits requests by the window's size."""


def register() -> None:
    """Register the spec and its manager with vLLM's registry (in every vLLM process: the worker reports the
    spec, the engine core builds the manager). vLLM registers its own specs lazily, only while its registry is
    empty, so they are registered first (``check_kv_cache_spec_registry`` of no layer does that and checks
    nothing). Registering the same pair again is allowed."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(BudgetedWindowSpec, BudgetedWindowManager,
                                 uniform_type_base_spec=SlidingWindowSpec)
