"""Eviction in rounds over vLLM's paged K/V blocks: one plan per engine step, one compiled call per layer.

vLLM keeps each layer's K/V in blocks of ``N`` tokens,
``kv_cache[num_blocks, H_kv, N, 2 * D]``; within a (block, KV head) the first
half holds K and the second V, in the layout of vLLM's CPU kernel for the
machine and dtype: "vec" (K transposed, ``[D, N]``, then V ``[N, D]``) or
"amx" (bf16 on CPUs with AMX: tiles of 16 tokens; :mod:`.blocks`). The plugin
presents a budgeted layer to vLLM as a sliding window of ``B`` slots (the
budget), so vLLM's own block manager frees every block that falls behind the
window. What this module adds is *which tokens live in those slots*, with the
core's semantics of eviction in rounds (:mod:`scissorhands.core.tokens.rounds`), and
the layer's attention itself, which replaces vLLM's kernel call:

* **A round** (:mod:`.rounds`). When a request's window is full and no victim is pending, the
  layer scores the window's tokens with the method (the core's
  :class:`~scissorhands.core.methods.base.LayerView` over them, in position
  order), picks the ``drop`` lowest with the core's
  :func:`~scissorhands.core.tokens.selection.lowest` (recent window and protected
  spans shielded, older first among equals), and swaps them into the ``drop``
  slots that leave the window next, oldest victim first. The window then
  drops one victim per step with no move, and whole blocks leave it: vLLM
  frees them with no patch to its scheduler. A round moves at most
  ``2 * drop`` slots per KV head.
* **A decode step** attends each request's new query over its window, the
  logical slots ``(p - B, p]``, and adds its probabilities to an importance
  accumulator kept per *physical* slot: one compiled operator per layer for
  every request (:mod:`.kernels`), which reads each window's K and V once,
  where they lie. It records the new token's position. Nothing else runs
  unless a request starts a round.
* **A prompt** (a request's first chunk; :mod:`.prompt`) is taken by the core's prefill in a
  one-row layer: the same code and numbers as the transformers cache. The
  prompt-aware prefill attends it exactly and evicts it to ``B`` once; the
  streamed one gives each token past the budget the kept set, in rounds (a
  round's tokens are one masked block attention, its victims hidden from the
  query at which each leaves on), and ends with up to ``drop`` victims pending. That gives its outputs, its
  importance and the ``B`` tokens it keeps; pending victims are copied into the
  slots that leave the window next, by rank, and other kept tokens that lie
  before the window into the remaining free slots.
* **One plan per step** (:class:`.planner.Planner`): which rows are prompts, decode
  steps and rounds, as index tensors, computed once on the host from vLLM's
  metadata and shared by every layer; a layer's step reads no value back from a
  tensor.

Keys are stored after rotary embedding and each slot's true position is kept
beside it (``pos``), so a token means its own position whatever slot it is in.
The transformers cache with ``rounds=True`` keeps the same positions (tested).

Nothing here imports vLLM: it is torch on vLLM's tensors, and is tested on
tensors of the same layout without an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import Protection

from . import kernels, prompt
from .blocks import phys, read_kv
from .rounds import round_layers
from .settings import PluginSettings

if TYPE_CHECKING:
    from .planner import StepPlan


class PagedLayer:
    """One layer's eviction state for every request vLLM runs, kept per physical slot of vLLM's cache.

    Parameters
    ----------
    settings : PluginSettings
    layer_idx : int
    num_heads, num_kv_heads, head_size : int
    scale : float
        Logit scale.
    softcap : float or None
    compiled : bool
        The decode step and the rounds run the compiled operators (:mod:`.kernels`); False runs their torch
        references (tests).
    layout : str
        vLLM's CPU K/V layout (:data:`.kernels.LAYOUTS`).
    fp8 : str or None
        vLLM's 8-bit K/V format (``kv_cache_dtype``: "fp8", "fp8_e4m3", "fp8_e5m2"), or None for the model's dtype.
    k_scale, v_scale : float
        vLLM's fp8 scales: a stored byte's value times these is the key's, the value's.

    Notes
    -----
    Per physical slot and KV head the layer keeps the token's position (int32) and, for methods that score by
    attention, ``n_buckets`` float32 accumulators: 4 bytes for the defaults' one bucket against 2 * D * 4 bytes
    of float32 K/V (under 1% at D = 64), allocated once beside vLLM's cache at the first step.
    """

    def __init__(self, settings: PluginSettings, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int,
                 scale: float, softcap: float | None, compiled: bool = True, layout: str = "vec",
                 fp8: str | None = None, k_scale: float = 1.0, v_scale: float = 1.0):
        if layout not in kernels.LAYOUTS:
            raise ValueError(f"layout: vLLM's CPU K/V layout {layout!r} is not one the plugin reads "
                             f"({', '.join(kernels.LAYOUTS)})")
        if fp8 is not None and fp8 not in kernels.FP8:
            raise ValueError(f"kv_cache_dtype: the plugin reads vLLM's fp8 formats {', '.join(kernels.FP8)}, "
                             f"got {fp8!r}")
        self.settings = settings
        self.layout = layout
        self.fp8, self.k_scale, self.v_scale = fp8, float(k_scale), float(v_scale)
        config, part = settings.config, settings.plan.layers[0]  # every layer the plan's one
        self.budget, self.recent, self.drop = part.budget, part.recent, part.drop
        #: A request's window: the slots after what it holds (the budget, less a held prefix: ``settings.window``).
        self.window = self.budget - settings.held_prefix
        self.layer_idx, self.scale, self.softcap = layer_idx, scale, softcap
        self.heads, self.kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.group = num_heads // num_kv_heads
        self.method = settings.method()
        template = self.method.make_state(config)
        self.importance = template if isinstance(template, ImportanceState) else None
        self.shields: list[Protection] = [Protection.prefix(config.sinks)] if config.sinks else []
        if settings.protection() is not None:
            self.shields.append(settings.protection())  # type: ignore[arg-type]
        self.compiled = compiled
        self.decode = kernels.decode if compiled else kernels.decode_reference
        #: Prompts longer than the budget attended by the compiled prompt operator and, for the queries whose
        #: probabilities nothing reads, torch's fused attention (:func:`.prompt.hold_fused`); False: by the
        #: core's tiled pass, as the transformers cache attends them.
        self.fused_prompt = compiled
        self.prompts_fused = 0  # prompts attended that way (tests)
        self.head_queries_fused = 0  # of their queries, those attended by torch's fused attention (tests)
        self.prompts_held_whole = 0  # held prompts attended in one fused call (:func:`.prompt.held_whole`; tests)
        self.acc: torch.Tensor | None = None  # (NB, num_blocks, H_kv, N) float32
        self.pos: torch.Tensor | None = None  # (num_blocks * N, H_kv) int32: each slot's token position
        self.rounds = 0
        self.block = 0  # vLLM's block size, known at the first step
        self.kv_cache: torch.Tensor | None = None  # vLLM's cache of this layer, known at the first step
        #: The engine's path: a step's rounds wait for :meth:`Planner.after_step`, which runs every layer's at once.
        self.defer_rounds = False

    def budgeted(self, store, prefill=None, rounds: bool = False) -> BudgetedKV:
        """A one-row core layer at these settings (a prompt's, or the transformers cache's in tests): the plan's,
        over the given store, prefill mode and eviction in rounds."""
        made = self.settings.plan.layer(0, self.layer_idx, store=store, prefill=prefill, rounds=rounds,
                                        method=self.method)
        assert isinstance(made, BudgetedKV)  # no head groups: the plugin refuses head-level budgets
        return made

    def nbytes(self) -> int:
        """Bytes of the per-slot state (positions and importance)."""
        return sum(t.numel() * t.element_size() for t in (self.acc, self.pos) if t is not None)

    def _allocate(self, kv_cache: torch.Tensor) -> None:
        nb, h, n, _ = kv_cache.shape
        self.pos = torch.full((nb * n, h), -1, dtype=torch.int32, device=kv_cache.device)
        if self.importance is not None:
            self.acc = torch.zeros(self.importance.n_buckets, nb, h, n, dtype=torch.float32, device=kv_cache.device)

    # -- one engine step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Attend this layer's step and account for it; vLLM's cache update has written the step's K/V.

        query (T, H_q, D), key/value (T, H_kv, D) of the step's tokens, rows in the plan's order; ``output``
        (T, H_q, D) receives every row's attention: the prompts' exact, the decode rows' over their windows.
        """
        if self.pos is None:
            self._allocate(kv_cache)
        assert self.pos is not None
        block = self.block = kv_cache.shape[2]
        self.kv_cache = kv_cache
        for i, a, b, held, cached in plan.prefills:
            spans = None if plan.protect is None else plan.protect.get(i)
            if cached:
                prompt.prefill_after(self, cached, plan.block_table[i], query[a:b], key[a:b], value[a:b], kv_cache,
                                     output[a:b], held, spans)
            else:
                prompt.prefill(self, plan.block_table[i], query[a:b], key[a:b], value[a:b], kv_cache, output[a:b],
                               held, spans)
        if plan.dec_tok is not None and plan.dec_last is not None:
            self.pos[plan.dec_slots] = plan.dec_last.to(torch.int32)[:, None]
            ctx = torch.empty(plan.dec_tok.shape[0], self.heads, self.head_size)  # (Dn, H_q, D) float32
            count = self.importance is not None and self.importance.form == "count"
            self.decode(query, kv_cache, plan.dec_tok, plan.dec_last, plan.dec_tables, plan.dec_bucket,
                        plan.dec_restart, self.acc, ctx, self.window, self.scale, self.softcap, count, self.layout,
                        self.fp8, self.k_scale, self.v_scale, plan.dec_held)
            output.index_copy_(0, plan.dec_tok, ctx.to(output.dtype))
        if plan.round_window is not None and plan.round_seen is not None and not self.defer_rounds:
            self._round(plan.round_window, plan.round_seen, kv_cache, block, plan.round_spans)

    def _round(self, window: torch.Tensor, seen: torch.Tensor, kv_cache, block: int,
               spans: torch.Tensor | None = None) -> None:
        """Each rounding row picks ``drop`` victims per KV head and swaps them into its window's leaving slots;
        ``spans`` (Rr, S, 2): the rows' own protected spans, or None."""
        assert self.pos is not None
        round_layers([self], self.pos[None], None if self.acc is None else self.acc[None], [kv_cache], window, seen,
                     block, spans)

    def read(self, kv_cache, blocks, heads, offs) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the slots as the model sees them: float32 from fp8 bytes, else in the cache's dtype."""
        k, v = read_kv(kv_cache, self.layout, blocks, heads, offs)
        if not self.fp8:
            return k, v
        return kernels.dequantize(k, self.fp8, self.k_scale), kernels.dequantize(v, self.fp8, self.v_scale)

    def stored_positions(self, table_row: torch.Tensor, seen: int, held: int = 0) -> torch.Tensor:
        """The positions a request's window (and its ``held`` prompt) holds per KV head, ascending (H_kv, L): tests
        and audits."""
        assert self.pos is not None
        held = min(held, seen)
        positions = torch.cat([torch.arange(held), torch.arange(max(held, seen - self.window), seen)])
        return self.pos[phys(table_row, positions, self.block)].T.long().sort(dim=-1).values

