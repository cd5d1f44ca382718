"""The budgeted layer's KV-cache spec and block manager, registered through vLLM's KV-cache spec registry.

A layer the plugin budgets holds at most ``budget`` tokens per request: to
vLLM's block manager it is a window of ``budget`` slots, whose blocks are freed
as they fall behind it (the plugin swaps the victims of each round into the
slots that leave the window next, :mod:`.rounds`). vLLM 0.32 lets a plugin bring
its own spec class and the manager that serves it
(``vllm/v1/kv_cache_spec_registry.py``); the plugin's worker reports
:class:`BudgetedWindowSpec` for each budgeted layer, and vLLM's engine builds a
:class:`BudgetedWindowManager` for it. Both are vLLM's sliding window today
(same sizes, same grouping with other sliding windows of the same length, the
same frees). With a held prompt (``prefill="keep-prompt"``) a request's window
depends on it: its prompt's blocks stay until it ends, and the blocks between
them and the last ``budget`` positions are freed as they fall behind (the gap
vLLM's own R-SWA manager frees, ``RSWAManager``), so a request holds its prompt
plus the budget (``docs/vllm.md``, "A window per request").
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class BudgetedWindowSpec(SlidingWindowSpec):
    """A budgeted full-attention layer: a window of ``sliding_window`` = the budget (tokens per request and KV
    head). vLLM groups it with its own sliding windows (``uniform_type_base_spec``) and sizes it as one.

    ``held_prompt``: each request also keeps its whole prompt (``prefill="keep-prompt"``), so a request may hold
    up to the model's length: admitted and sized as full attention is."""

    held_prompt: bool = False

    @property
    def budget(self) -> int:
        return self.sliding_window

    @classmethod
    def of(cls, spec: FullAttentionSpec, budget: int, held_prompt: bool = False) -> BudgetedWindowSpec:
        """The layer's full-attention spec (vLLM's, from the layer) as a window of ``budget``: the same shape,
        dtype and K/V quantisation."""
        return cls(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                   head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                   sliding_window=budget, held_prompt=held_prompt)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        if not self.held_prompt:
            return super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        return cdiv(max_model_len, self.block_size) + 1  # a prompt as long as the model takes, held whole


class BudgetedWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager over a :class:`BudgetedWindowSpec`: it counts a request's blocks by the
    window, frees each block once it lies behind it, and admits requests by the window's size.

    With a held prompt (admitted as full attention is, :class:`BudgetedWindowSpec`) it frees instead the blocks
    wholly between the prompt's last block and the window (the positions ``[P, n - B + 1)`` for the token at
    position ``n``, as the decode operator attends ``[0, P)`` and ``[max(P, n - B + 1), n]``)."""

    def __init__(self, kv_cache_spec: BudgetedWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.held_prompt = kv_cache_spec.held_prompt

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if not self.held_prompt:
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
            return
        if num_prompt_tokens is None:  # vLLM passes it wherever it frees; without it, nothing is known to be behind
            return
        first = cdiv(num_prompt_tokens, self.block_size)  # the first block wholly after the prompt
        last = (processed_computed_tokens - self.sliding_window + 1) // self.block_size  # wholly behind the window
        if last > first:
            self._remove_blocks_in_range(request_id, first, last)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0 if self.held_prompt else super().get_num_skipped_tokens(num_computed_tokens)


def register() -> None:
    """Register the spec and its manager with vLLM's registry (in every vLLM process: the worker reports the
    spec, the engine core builds the manager). vLLM registers its own specs lazily, only while its registry is
    empty, so they are registered first (``check_kv_cache_spec_registry`` of no layer does that and checks
    nothing). Registering the same pair again is allowed."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(BudgetedWindowSpec, BudgetedWindowManager,
                                 uniform_type_base_spec=SlidingWindowSpec)
