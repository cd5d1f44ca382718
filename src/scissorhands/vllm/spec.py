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

A held prefix (the protected prefix of ``N`` tokens, with another prefill) is
held the same way: its blocks stay, and the window after it holds the rest of
the budget, ``B - N`` slots.

A held prompt or prefix is never rewritten (only the window after it is), so its
whole blocks can serve vLLM's prefix cache: a request whose prompt begins with
another one's (a shared system prompt, the earlier turns of a chat) takes those
blocks as they are and computes only the rest. The manager then finds hits as
full attention does (whole blocks from the first), and caches a request's blocks
only up to the last whole block of what it holds: the blocks after it hold the
window, whose slots the rounds rearrange, so no later request may take them by
their tokens. A prompt-aware prefill judges the prompt by its last ``observe``
queries, which a hit must leave to be computed.
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
    up to the model's length: admitted and sized as full attention is. ``held_prefix``: each request keeps its
    first ``held_prefix`` tokens beside the window (the protected prefix), admitted with the window.
    ``observed``: the prompt's last queries a prompt-aware prefill judges it by, never taken from the cache."""

    held_prompt: bool = False
    held_prefix: int = 0
    observed: int = 0

    @property
    def budget(self) -> int:
        return self.sliding_window + self.held_prefix

    @property
    def holds(self) -> bool:
        """Whether a request keeps positions from its first beside the window (a prompt or a prefix)."""
        return self.held_prompt or self.held_prefix > 0

    @classmethod
    def of(cls, spec: FullAttentionSpec, window: int, held_prompt: bool = False, held_prefix: int = 0,
           observed: int = 0) -> BudgetedWindowSpec:
        """The layer's full-attention spec (vLLM's, from the layer) as a window of ``window`` slots (after what a
        request holds): the same shape, dtype and K/V quantisation."""
        return cls(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
                   head_size_v=spec.head_size_v, dtype=spec.dtype, kv_quant_mode=spec.kv_quant_mode,
                   sliding_window=window, held_prompt=held_prompt, held_prefix=held_prefix, observed=observed)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        if self.held_prompt:
            return cdiv(max_model_len, self.block_size) + 1  # a prompt as long as the model takes, held whole
        window = super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        return min(window + cdiv(self.held_prefix, self.block_size), cdiv(max_model_len, self.block_size) + 1)


class BudgetedWindowManager(SlidingWindowManager):
    """vLLM's sliding-window manager over a :class:`BudgetedWindowSpec`: it counts a request's blocks by the
    window, frees each block once it lies behind it, and admits requests by the window's size.

    With a held prompt (admitted as full attention is, :class:`BudgetedWindowSpec`) it frees instead the blocks
    wholly between the prompt's last block and the window (the positions ``[P, n - B + 1)`` for the token at
    position ``n``, as the decode operator attends ``[0, P)`` and ``[max(P, n - B + 1), n]``)."""

    def __init__(self, kv_cache_spec: BudgetedWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.held_prompt = kv_cache_spec.held_prompt
        self.held_prefix = kv_cache_spec.held_prefix
        self.holds = kv_cache_spec.holds

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if not self.holds:
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
            return
        held = self.held_prefix
        if self.held_prompt:
            if num_prompt_tokens is None:  # vLLM passes it wherever it frees; without it, nothing is known behind
                return
            held = num_prompt_tokens
        first = cdiv(held, self.block_size)  # the first block wholly after what the request holds
        last = (processed_computed_tokens - self.sliding_window + 1) // self.block_size  # wholly behind the window
        if last > first:
            self._remove_blocks_in_range(request_id, first, last)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0 if self.holds else super().get_num_skipped_tokens(num_computed_tokens)

    # -- vLLM's prefix cache, with a held prompt --------------------------------------------------------------
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block, alignment_tokens, dcp_world_size=1, pcp_world_size=1):
        """With a held prompt or prefix, the longest run of cached whole blocks from the first (a request attends
        them from position 0, so a hit must hold them all, as full attention's does), short of the queries a
        prompt-aware prefill observes (``max_length`` is the sequence less its last token); else the sliding
        window's hit."""
        if not getattr(kv_cache_spec, "holds", False):
            return super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool,
                                                  kv_cache_spec, drop_eagle_block, alignment_tokens,
                                                  dcp_world_size, pcp_world_size)
        block = kv_cache_spec.block_size
        max_length = max(0, min(max_length, max_length + 1 - kv_cache_spec.observed))
        found: tuple[list, ...] = tuple([] for _ in kv_cache_group_ids)
        # vLLM hashes at its hash block size; ``resolve_block_hashes`` gives one hash per block of this layer.
        hashes = _resolve(block_hashes, block_pool.hash_block_size, block, alignment_tokens)
        for i in range(min(max_length // block, len(hashes))):
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not cached:
                break
            for blocks, one in zip(found, cached):
                blocks.append(one)
        if drop_eagle_block and found[0]:
            for blocks in found:
                blocks.pop()
        return found, len(found[0]) * block

    @classmethod
    def reachable_block_mask(cls, start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                             retention_interval=None, reachable_boundaries=(), dcp_world_size=1,
                             final_segment_end_block=None):
        """With a held prompt or prefix, every cached block can serve a hit (all are read from the first): no
        mask."""
        if getattr(kv_cache_spec, "holds", False):
            return None
        return super().reachable_block_mask(start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle,
                                            retention_interval, reachable_boundaries, dcp_world_size,
                                            final_segment_end_block)

    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries=()):
        """With a held prompt or prefix, only its whole blocks are offered to the prefix cache: the blocks after it
        hold the window, whose slots the rounds rearrange."""
        if self.holds:
            held = request.num_prompt_tokens if self.held_prompt else self.held_prefix
            num_tokens = min(num_tokens, held // self.block_size * self.block_size)
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)


def _resolve(block_hashes, hash_block_size: int, block: int, alignment_tokens: int):
    """One hash per ``block`` tokens, as vLLM's managers read them (``resolve_block_hashes``)."""
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes

    return resolve_block_hashes(block_hashes, hash_block_size, block,
                                supports_fine_grained_hash_lookup=False, alignment_tokens=alignment_tokens)


def register() -> None:
    """Register the spec and its manager with vLLM's registry (in every vLLM process: the worker reports the
    spec, the engine core builds the manager). vLLM registers its own specs lazily, only while its registry is
    empty, so they are registered first (``check_kv_cache_spec_registry`` of no layer does that and checks
    nothing). Registering the same pair again is allowed."""
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(BudgetedWindowSpec, BudgetedWindowManager,
                                 uniform_type_base_spec=SlidingWindowSpec)
