"""The plugin's worker: it owns the engine's eviction state and hands it to the attention layers.

vLLM builds attention layers with no handle to their worker, and its attention
metadata carries no request ids. The plugin's worker (a ``CPUWorker``) closes
both gaps without module globals: after the model loads it parses the plugin's
settings once, finds the model's full-attention layers through vLLM's own
registry of them (``get_layers_from_vllm_config``) and attaches one
:class:`EngineState` to each (the layer becomes a window of the budget, so
vLLM's block manager frees what falls behind it), refuses a model with no such
layer or with an attention layer of another kind (:func:`attention_kind`), and
builds or loads the compiled operator; once vLLM has grouped the layers' caches
it refuses budgeted layers split over several KV-cache groups; all before the engine
serves (:mod:`.build`: never inside a request). A refusal here is one line for
``LLM(...)``, and under a server it is left for the front end to say
(:func:`~.refusals.refuse_in_engine`). Each budgeted layer's cache is reported as
the plugin's own spec (:mod:`.spec`). For every step it publishes
the runner (whose input batch holds the request ids in row order) and a step
number (every budgeted layer reuses its step's one plan), hands finished
requests to the planner, and runs the step's rounds for every layer at once
when the model's forward is done.
"""

from __future__ import annotations

import logging

from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
from vllm.model_executor.layers.attention.prefill_prefix_lm_attention import PrefillPrefixLMAttention
from vllm.v1.attention.backend import AttentionType
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.worker.cpu_worker import CPUWorker

from scissorhands.core.tokens.importance import ImportanceState

from . import kernels
from .build import BuildError
from .paged import PagedLayer
from .planner import Planner
from .plugin import refuse_groups, refuse_layer, refuse_state
from .refusals import refuse_in_engine
from .settings import PluginSettings, Refusal, from_vllm
from .spec import BudgetedWindowSpec

logger = logging.getLogger("vllm.scissorhands")  # under vLLM's logger, so its lines show with vLLM's


def attention_kind(layer: Attention) -> str | None:
    """What an attention layer is, in words, unless it is plain decoder self-attention (None), the one kind the
    plugin can attend as a causal window: not a layer that reads another layer's K/V, an encoder, encoder-only or
    cross-attention layer, nor a subclass of vLLM's ``Attention`` with a mask or cache of its own (chunked local,
    prefix-LM, static sinks, ...). A plain layer with a sliding window is plain: it keeps its native window."""
    target = getattr(layer, "kv_sharing_target_layer_name", None)
    if target:
        return f"a layer that reads the KV cache of layer {target} (KV sharing)"
    kind = getattr(layer, "attn_type", AttentionType.DECODER)
    if kind != AttentionType.DECODER:
        return {AttentionType.ENCODER_ONLY: "encoder-only attention (bidirectional, no KV cache)",
                AttentionType.ENCODER: "encoder attention (of an encoder-decoder model)",
                AttentionType.ENCODER_DECODER: "cross-attention (decoder queries over the encoder's K/V)"}.get(
                    kind, f"attention of type {kind!r}")
    if isinstance(layer, ChunkedLocalAttention):
        return f"chunked local attention (each query attends within its chunk of {layer.attention_chunk_size} tokens)"
    if isinstance(layer, PrefillPrefixLMAttention):
        return "prefix-LM attention (bidirectional over the prompt)"
    if type(layer) is not Attention:
        return f"a {type(layer).__name__} layer (a kind of attention of its own, not vLLM's plain Attention)"
    return None


class EngineState:
    """One engine's eviction state in one worker process: its settings, budgeted layers, planner and step."""

    def __init__(self, settings: PluginSettings):
        self.settings = settings
        self.layers: list[PagedLayer] = []  # made by each budgeted layer at its first step, in the model's order
        self.planner = Planner(settings)
        self.runner = None  # the model runner while a step runs; None in warm-up and profiling runs
        self.step = 0

    @property
    def in_step(self) -> bool:
        """Whether an engine step is running (warm-up and profiling runs are not steps)."""
        return self.runner is not None

    def request_ids(self) -> list[str]:
        """The running step's request ids in batch-row order."""
        return [] if self.runner is None else list(self.runner.input_batch.req_ids)


class ScissorhandsWorker(CPUWorker):
    """``CPUWorker``, with the plugin's state attached to the model's attention layers and advanced each step."""

    scissorhands: EngineState | None = None
    _budgeted: frozenset[str] = frozenset()

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        settings = from_vllm(self.vllm_config.additional_config)
        if settings is None:
            return
        try:
            self._attach(settings)
        except (Refusal, BuildError) as e:  # one line for LLM(...), and for a server's front end
            refuse_in_engine(e)

    def _attach(self, settings: PluginSettings) -> None:
        from .backend import ScissorhandsImpl

        self.scissorhands = EngineState(settings)
        names = []
        for name, layer in get_layers_from_vllm_config(self.vllm_config, Attention).items():
            if not isinstance(layer.impl, ScissorhandsImpl):
                continue
            refuse_layer(name, attention_kind(layer))  # before any layer is attached: nothing half-made
        for name, layer in get_layers_from_vllm_config(self.vllm_config, Attention).items():
            if isinstance(layer.impl, ScissorhandsImpl) and layer.impl.attach(self.scissorhands, name):
                names.append(name)
        if not names:
            raise Refusal("model: the scissorhands plugin found no layer it can budget (it budgets full-attention "
                          "decoder layers; every attention layer of this model has a sliding window or is not "
                          "vLLM's Attention); leave the scissorhands settings out to run it")
        self._budgeted = frozenset(names)
        # The operator is built (or loaded) now, while the engine starts, never inside a request.
        ops = kernels.build()
        logger.info("scissorhands: %d of the model's layers budgeted; paged attention operator loaded from %s",
                    len(names), ops.__file__)

    def initialize_from_config(self, kv_cache_config) -> None:
        """Refuse a model whose budgeted layers vLLM splits into several KV-cache groups (each group has its own
        block table; the plugin plans a step once, from one), and per-slot state that would not fit beside the
        cache (:meth:`_refuse_state`), before the cache is allocated."""
        if self.scissorhands is not None:
            groups = [[name for name in group.layer_names if name in self._budgeted]
                      for group in kv_cache_config.kv_cache_groups]
            try:
                refuse_groups([group for group in groups if group])
                self._refuse_state(kv_cache_config)
            except Refusal as e:
                refuse_in_engine(e)
        super().initialize_from_config(kv_cache_config)

    def _refuse_state(self, kv_cache_config) -> None:
        """The budgeted layers' per-slot state (:func:`~.plugin.state_bytes`) against the memory free once vLLM's
        cache, about to be allocated, is taken from it (:func:`~.plugin.refuse_state`)."""
        assert self.scissorhands is not None
        template = self.scissorhands.settings.method().make_state(self.scissorhands.settings.config)
        buckets = template.n_buckets if isinstance(template, ImportanceState) else 0
        spec = next((g.kv_cache_spec for g in kv_cache_config.kv_cache_groups
                     if any(name in self._budgeted for name in g.layer_names)), None)
        if spec is None or not hasattr(spec, "block_size") or not hasattr(spec, "num_kv_heads"):
            return
        cache = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        free = _available_bytes()
        refuse_state(kv_cache_config.num_blocks * spec.block_size, spec.num_kv_heads, len(self._budgeted), buckets,
                     None if free is None else free - cache)

    def get_kv_cache_spec(self):
        """vLLM's specs, each budgeted layer's a window of the budget (:class:`~.spec.BudgetedWindowSpec`,
        registered with vLLM with its block manager): the manager then frees every block behind the window, and
        the blocks of evicted tokens go back."""
        specs = super().get_kv_cache_spec()
        if self.scissorhands is None:
            return specs
        for name in self._budgeted:
            spec = specs.get(name)
            if type(spec) is FullAttentionSpec:
                settings = self.scissorhands.settings
                specs[name] = BudgetedWindowSpec.of(spec, settings.window,
                                                    held_prompt=settings.config.prefill == "keep-prompt",
                                                    held_prefix=settings.held_prefix,
                                                    observed=_observed(settings))
        return specs

    def execute_model(self, scheduler_output):
        state = self.scissorhands
        if state is None:
            return super().execute_model(scheduler_output)
        state.runner = self.model_runner
        state.step += 1
        state.planner.release(getattr(scheduler_output, "finished_req_ids", None) or ())
        resumed = getattr(getattr(scheduler_output, "scheduled_cached_reqs", None), "resumed_req_ids", None) or ()
        new = list(getattr(scheduler_output, "scheduled_new_reqs", ()))
        state.planner.begin([*(r.req_id for r in new), *resumed],
                            {r.req_id: spans for r in new if (spans := _protected(state.settings, r))})
        try:
            output = super().execute_model(scheduler_output)
            state.planner.after_step(state.step, state.layers)  # the forward is done: every layer's rounds at once
            return output
        finally:
            state.runner = None

    def scissorhands_kept(self) -> dict[str, list]:
        """Per live request, per budgeted layer of this worker, the positions each of its KV heads stores
        (ascending): what ``LLM.collective_rpc("scissorhands_kept")`` returns per rank, for tests and audits.
        Under tensor parallelism a rank holds its shard of the KV heads."""
        state = self.scissorhands
        if state is None:
            return {}
        held = state.planner.held
        return {rid: [layer.stored_positions(row, seen, held.get(rid, 0)).tolist() for layer in state.layers]
                for rid, (row, seen) in state.planner.where.items()}


def _protected(settings: PluginSettings, request) -> list[tuple[int, int]]:
    """A new request's own protected spans (checked in the front end already: a list that fails here is logged
    and the request runs unprotected, never the engine stopped)."""
    params = getattr(request, "sampling_params", None)
    try:
        return settings.request_protection(getattr(params, "extra_args", None), len(request.prompt_token_ids or ()))
    except ValueError as e:
        logger.warning("scissorhands: request %s: %s; it runs without them", request.req_id, e)
        return []


def _observed(settings) -> int:
    """The prompt's last queries whose attention chooses what a prompt-aware prefill keeps (0 for another mode):
    vLLM's prefix cache must not give them (:class:`~.spec.BudgetedWindowSpec`)."""
    return settings.config.observe if settings.config.prefill == "prompt-aware" else 0


def _available_bytes() -> int | None:
    """The memory this machine has free for new allocations (``MemAvailable``), or None where it cannot say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
