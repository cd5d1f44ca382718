"""The ``vllm.general_plugins`` entry point: registers the attention backend and prepares the engine config.

vLLM calls :func:`register` in each of its processes. It registers
:class:`~.backend.ScissorhandsBackend` over ``CPU_ATTN`` (a subclass that is
exactly the parent while the plugin is off) and extends the CPU platform's
config step so that, when the ``scissorhands`` settings are present, they are
checked at start-up (a one-line error naming the bad one), what the plugin
cannot serve is refused (:func:`refuse_unservable`: pipeline parallelism,
speculative decoding, a K/V dtype it cannot read, a KV connector, more tensor
parallel ranks than KV heads; :func:`check_platform`: a platform other than the
CPU one; :func:`check_layout`: a K/V layout the operator cannot read;
:func:`refuse_declared`: what the worker would refuse once the layers exist, as
far as the model's config declares it), the plugin's worker is used, and prefix
caching, chunked prefill and ``long_prefill_token_threshold`` are turned off
(a prompt must be held whole and attended once; a shared prefix block cannot be
evicted for one request alone), saying so in the log. Each refusal is one line
before the engine starts: ``LLM(...)`` raises it as a ``ValueError``, and the
OpenAI server prints it and exits with code 2. The compiled operator is built
(or loaded) there too, before any engine starts (:mod:`.build`).

What only the layers vLLM builds can show (a kind of attention no config
declares, KV-cache groups the config's ``layer_types`` do not predict, per-slot
state that would not fit beside the cache vLLM sized: :func:`refuse_state`) is
refused by the plugin's worker, in the engine's process. The front end names a
file for it (:func:`~.refusals.await_refusals`, through
``SCISSORHANDS_VLLM_REFUSAL``, which the engine's processes inherit); the worker
writes its line there and ends the engine quietly
(:func:`~.refusals.refuse_in_engine`). ``LLM(...)`` then raises that line in
place of vLLM's failed engine start; a server prints it and exits with code 2.
How a refusal reaches the user from either process is :mod:`.refusals`.

The start-up steps extend three vLLM methods in place (the config step, the
engine config, ``LLMEngine.from_engine_args``), since vLLM 0.32 has no hook
for them: a general plugin gets no config step, and a platform plugin (a
``CpuPlatform`` subclass) is skipped when ``VLLM_TARGET_DEVICE=cpu``, where vLLM
returns its CPU platform before it loads platform plugins
(``vllm.platforms.resolve_current_platform_cls_qualname``).
"""

from __future__ import annotations

import copy
import functools
import logging

from .refusals import await_refusals, quiet_failed_start, refusal_in, refuse, take_recorded
from .settings import KEY as PLUGIN
from .settings import Refusal

#: The ``layer_types`` of a layer with a full-attention cache, the only kind the plugin budgets.
FULL_ATTENTION = ("full_attention", "attention")
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

    from . import kernels, spec
    from .build import BuildError
    from .settings import from_vllm

    register_backend(AttentionBackendEnum.CPU_ATTN, "scissorhands.vllm.backend.ScissorhandsBackend")
    spec.register()  # the budgeted layers' KV-cache spec and its block manager, in vLLM's registry
    original = CpuPlatform.check_and_update_config.__func__
    create = EngineArgs.create_engine_config
    validate = CpuPlatform.validate_request.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        prepare_config(vllm_config)

    def create_engine_config(self, *args, **kwargs):
        # A bad setting is checked before vLLM builds its config; a refusal of the config step is taken out of the
        # many-line validation report vLLM wraps it in; the operator is built before any engine starts.
        context = kwargs.get("usage_context", args[0] if args else None)
        server = getattr(context, "value", context) in SERVERS
        try:
            settings = from_vllm(self.additional_config)
            if settings is not None:
                check_platform(current_platform())
        except ValueError as e:
            refuse(e, server)
        _FRONT[:] = [settings]  # what this process's requests are checked against (validate_request)
        try:
            config = create(self, *args, **kwargs)
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            refusal = refusal_in(e)
            if refusal is None:
                raise
            refuse(refusal, server)
        if settings is not None:
            try:
                kernels.build()
            except BuildError as e:
                refuse(e, server)
            await_refusals(server)
        return config

    from vllm.v1.engine.llm_engine import LLMEngine

    from_engine_args = LLMEngine.from_engine_args.__func__

    def engine_from_args(cls, *args, **kwargs):
        # ``LLM(...)``: an engine process that refused (the worker, once the layers exist) left its line; vLLM's
        # report of the failed start ("Engine core initialization failed") becomes the plugin's one-line error.
        try:
            return from_engine_args(cls, *args, **kwargs)
        except RuntimeError:
            line = take_recorded()
            if line is None:
                raise
            raise Refusal(line) from None

    def validate_request(cls, processed_inputs, params) -> None:
        # A request's own protected spans, checked in the front end: a bad list is that request's error, never the
        # engine's.
        validate(cls, processed_inputs, params)
        check_request(processed_inputs, params)

    check_and_update_config.scissorhands = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    CpuPlatform.validate_request = classmethod(validate_request)
    EngineArgs.create_engine_config = create_engine_config
    LLMEngine.from_engine_args = classmethod(engine_from_args)
    quiet_failed_start()


#: The settings of the engine this process made last (None: the plugin off), which its requests are checked against.
_FRONT: list = [None]


def check_request(processed_inputs, params) -> None:
    """A request's protected spans (``extra_args["scissorhands_protect"]``) against its prompt and the engine's
    settings: a one-line ``ValueError`` naming the key, which vLLM returns as that request's error."""
    from .settings import PROTECT

    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict) or PROTECT not in extra:
        return
    settings = _FRONT[0]
    tokens = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
    try:
        if settings is None:
            raise ValueError(f"{PROTECT}: the scissorhands plugin is off in this engine (no 'scissorhands' settings)")
        if tokens is None:
            raise ValueError(f"{PROTECT}: protects the token positions of a text prompt (this request has none)")
        settings.request_protection(extra, len(tokens))
    except ValueError as e:
        raise _request_refusal()(str(e)) from None


@functools.lru_cache(maxsize=1)
def _request_refusal() -> type:
    """The error of a request's bad setting: a ``ValueError`` for ``LLM(...)``, and vLLM's client error for its
    server, which answers that request 400 and serves on (a plain ``ValueError`` raised while a request is added
    reaches the client as a 500)."""
    from vllm.exceptions import VLLMValidationError

    return type("RequestRefusal", (VLLMValidationError, ValueError), {"__module__": __name__})


def current_platform():
    """vLLM's platform in this process (resolved by vLLM on first use)."""
    import vllm.platforms

    return vllm.platforms.current_platform


def check_platform(platform) -> None:
    """Refuse any platform but vLLM's CPU one: the plugin extends the CPU platform's config step and ``CPU_ATTN``
    alone, so on another platform it would check its settings and evict nothing."""
    refuse_platform(getattr(platform, "device_name", type(platform).__name__), platform.is_cpu())


def check_layout(vllm_config) -> None:
    """Refuse a K/V layout the operator cannot read, from the dtype, block size and head size vLLM's CPU kernel
    picks its layout by (``_get_attn_isa``), before the engine starts; the backend checks each layer again in the
    warm-up run."""
    from vllm.v1.attention.backends import cpu_attn

    from . import kernels

    model, cache = vllm_config.model_config, vllm_config.cache_config
    if model is None:
        return
    try:
        layout = cpu_attn._get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    except NotImplementedError:  # a K/V dtype vLLM's CPU kernel refuses here itself (fp8 without AVX-512)
        return
    refuse_layout(layout, kernels.LAYOUTS)


def prepare_config(vllm_config) -> None:
    """With the plugin on: refuse what it cannot serve (one line each), use its worker, hold prompts whole."""
    from .settings import from_vllm

    settings = from_vllm(vllm_config.additional_config)  # a bad setting: ValueError("<setting>: ...")
    if settings is None:
        return
    refuse_unservable(vllm_config)
    refuse_declared(vllm_config, settings.window)
    check_layout(vllm_config)
    parallel = vllm_config.parallel_config
    ours = "scissorhands.vllm.worker.ScissorhandsWorker"  # the config is prepared again in the engine's process
    if parallel.worker_cls not in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker", ours):
        raise Refusal(f"worker_cls: the scissorhands plugin brings its own worker, got {parallel.worker_cls!r}")
    parallel.worker_cls = ours
    cache, scheduler, model = vllm_config.cache_config, vllm_config.scheduler_config, vllm_config.model_config
    # A held prompt or prefix is never rewritten: its whole blocks can be shared.
    shares = settings.config.prefill == "keep-prompt" or settings.held_prefix > 0
    if (cache.enable_prefix_caching and not shares) or scheduler.enable_chunked_prefill:
        logger.info("scissorhands: %s off (each prompt is held whole, attended once and evicted to the budget%s)",
                    "chunked prefill is" if shares else "prefix caching and chunked prefill are",
                    "" if shares else "; prefill='keep-prompt' or protect_prefix keeps prefix caching")
    if not shares:
        cache.enable_prefix_caching = False
    scheduler.enable_chunked_prefill = False
    if scheduler.long_prefill_token_threshold:  # vLLM's scheduler cuts prompts at it even with chunked prefill off
        logger.info("scissorhands: long_prefill_token_threshold %d is reset to 0 (a prompt is held whole)",
                    scheduler.long_prefill_token_threshold)
        scheduler.long_prefill_token_threshold = 0
    if model is not None:
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model.max_model_len)
    logger.info("scissorhands: method %s, budget %d tokens per layer and KV head", settings.method.name,
                settings.budget)


def refuse_unservable(vllm_config) -> None:
    """A :class:`~.settings.Refusal` naming the first vLLM setting the plugin cannot serve, if any."""
    from . import kernels

    parallel, cache, model = vllm_config.parallel_config, vllm_config.cache_config, vllm_config.model_config
    if parallel.pipeline_parallel_size > 1:
        raise Refusal(f"pipeline_parallel_size: the scissorhands plugin is not tested with pipeline parallelism, "
                      f"got {parallel.pipeline_parallel_size}; run with 1 (tensor parallelism shards KV heads, "
                      f"which the plugin evicts per head)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise Refusal("speculative_config: the scissorhands plugin cannot serve speculative decoding (draft "
                      "tokens would be scored and evicted before they are accepted); leave it off")
    if cache.cache_dtype not in ("auto", None, *kernels.FP8):
        raise Refusal(f"kv_cache_dtype: the scissorhands plugin reads K/V in the model's dtype or vLLM's fp8 "
                      f"({', '.join(kernels.FP8)}), got {cache.cache_dtype!r}")
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if (transfer is not None and transfer.kv_connector) or getattr(cache, "kv_offloading_size", None):
        raise Refusal("kv_transfer_config: the scissorhands plugin cannot serve with a KV connector or KV "
                      "offloading (it moves K/V between slots as it evicts, so saved blocks would be rearranged, "
                      "and a prompt loaded in part would reach it in chunks); leave it off")
    if model is None:
        return
    # The worker refuses a model with no layer it can budget once the layers exist; a model that declares its layers'
    # kinds (transformers' ``layer_types``, which vLLM's models follow) is refused here, before the engine starts.
    kinds = getattr(model.hf_text_config, "layer_types", None)
    if kinds and not any(kind in FULL_ATTENTION for kind in kinds):
        raise Refusal(f"model: the scissorhands plugin budgets full-attention layers, and this model has none (its "
                      f"layer_types are {sorted(set(kinds))}); leave the scissorhands settings out to run it")
    heads = model.get_total_num_kv_heads()
    if parallel.tensor_parallel_size > heads:
        raise Refusal(f"tensor_parallel_size: {parallel.tensor_parallel_size} is more than the model's {heads} KV "
                      f"heads; the scissorhands plugin evicts per KV head, and ranks holding copies of one head would "
                      f"evict it differently: run with {heads} or fewer")


def refuse_declared(vllm_config, budget: int) -> None:
    """Refuse, from the model's config and before the engine starts, the layers the worker would refuse once vLLM
    has built them: attention of another kind than plain decoder self-attention (:func:`declared_kind`) and budgeted
    layers that vLLM would split over several KV-cache groups (:func:`predicted_groups`). What no config declares
    (an architecture that builds its own kind of attention layer) is still refused by the worker."""
    model = vllm_config.model_config
    if model is None:
        return
    kind = declared_kind(model.hf_config, model.hf_text_config, attn_type=model.attn_type)
    if kind is not None:
        raise Refusal(f"model: its config declares {kind}; the scissorhands plugin budgets plain decoder "
                      f"self-attention only and cannot serve this model; leave the scissorhands settings out to "
                      f"run it")
    groups = predicted_groups(vllm_config, budget)
    if groups is not None:
        refuse_groups([group for group in groups if group])


def predicted_groups(vllm_config, budget: int) -> list[list[str]] | None:
    """The budgeted layers (named ``layer <i>``) in each KV-cache group vLLM will make, predicted by vLLM's own
    grouping (``get_kv_cache_groups``) from the cache spec the worker reports for each layer (a
    :class:`~.spec.BudgetedWindowSpec` for a budgeted layer, vLLM's sliding window for a sliding one; windows by
    :func:`stand_in_windows`, one shape for every layer); None where the config's ``layer_types`` do not say it
    or vLLM's grouping fails on the stand-ins (the worker checks the real groups)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from .spec import BudgetedWindowSpec

    model, cache = vllm_config.model_config, vllm_config.cache_config
    text = model.hf_text_config
    kinds = getattr(text, "layer_types", None) or []
    windows = None if model.disable_sliding_window else stand_in_windows(kinds, getattr(text, "sliding_window", None),
                                                                         budget)
    if windows is None or cache.block_size is None:
        return None
    shape = dict(block_size=cache.block_size, num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
                 head_size=model.get_head_size(), dtype=model.dtype)
    specs = {f"layer {i}": (BudgetedWindowSpec if kind in FULL_ATTENTION else SlidingWindowSpec)(
        **shape, sliding_window=window) for i, (kind, window) in enumerate(zip(kinds, windows))}
    # The engine core resolves the K/V layout later; vLLM's grouping reads it only for layers of several page sizes,
    # and the stand-ins have one, so a copy of the config names one for the grouping to run here.
    config = copy.copy(vllm_config)
    config.cache_config = copy.copy(cache)
    config.cache_config.kv_cache_layout = cache.kv_cache_layout or "LBNHC"
    try:
        groups = get_kv_cache_groups(config, specs)
    except (AssertionError, ValueError, NotImplementedError):  # a grouping vLLM refuses; its engine will say why
        return None
    budgeted = {f"layer {i}" for i, kind in enumerate(kinds) if kind in FULL_ATTENTION}
    return [[name for name in group.layer_names if name in budgeted] for group in groups]


# -- start-up gates: what the plugin refuses once it knows the engine's platform, K/V layout and layers -----------
# Plain values in, a one-line :class:`Refusal` out, so each is tested without an engine; the plugin and its worker
# call them with what vLLM gives.

def refuse_platform(platform: str, is_cpu: bool) -> None:
    """The plugin serves on vLLM's CPU build only: elsewhere its backend and worker are never used (vLLM picks the
    platform's own), so it would check its settings and then evict nothing."""
    if not is_cpu:
        raise Refusal(f"{PLUGIN}: the plugin runs on vLLM's CPU build only, and this vLLM's platform is {platform!r}, "
                      f"where it would check its settings and evict nothing; leave the scissorhands settings out "
                      f"to run vLLM as it is")


def refuse_layout(layout: str, readable) -> None:
    """vLLM's CPU kernel lays K/V out per machine and dtype ("neon" on ARM, "vec" on x86, ...); the plugin's operator
    reads only ``readable``."""
    if layout not in readable:
        raise Refusal(f"{PLUGIN}: vLLM's CPU attention kernel takes the {layout!r} K/V layout on this machine, which "
                      f"the plugin cannot read (it reads {', '.join(readable)}); leave the scissorhands settings out "
                      f"to run vLLM as it is")


def refuse_layer(layer: str, kind: str | None) -> None:
    """A layer that is not plain decoder self-attention (``kind`` says what it is; None: plain), which the plugin
    would attend as a causal window of the budget."""
    if kind is not None:
        raise Refusal(f"model: layer {layer} is {kind}; the scissorhands plugin budgets plain decoder "
                      f"self-attention only and cannot serve this model; leave the scissorhands settings out to run "
                      f"it")


def refuse_groups(groups: list[list[str]]) -> None:
    """The budgeted layers, as vLLM's KV-cache groups split them (each group has its own block table): the plugin
    plans each step once from one block table, so they must all lie in one group."""
    if len(groups) > 1:
        named = "; ".join(f"{', '.join(g[:2])}{', ...' if len(g) > 2 else ''}" for g in groups)
        raise Refusal(f"model: vLLM splits this model's budgeted layers into {len(groups)} KV-cache groups ({named}), "
                      f"each with its own block table, and the scissorhands plugin serves one; leave the "
                      f"scissorhands settings out to run it")


# -- predictions from the model's config: what the worker would refuse once vLLM has built the layers -------------

def state_bytes(slots: int, kv_heads: int, layers: int, n_buckets: int) -> int:
    """Bytes of the per-slot state the budgeted layers keep beside vLLM's cache: each slot's position (int32) and
    ``n_buckets`` float32 importance accumulators, per KV head (0 buckets: a method that keeps no importance)."""
    return slots * kv_heads * layers * (4 + 4 * n_buckets)


def refuse_state(slots: int, kv_heads: int, layers: int, n_buckets: int, free: int | None) -> None:
    """Refuse, before vLLM allocates its cache, per-slot state that would take more than half the memory left beside
    it (``free``: None, not known): an exact importance window keeps a number per step of it for every slot, the
    state fills as slots are written while the engine's other memory grows beside it, and a worker that runs out
    of memory mid-request is killed without a word."""
    need = state_bytes(slots, kv_heads, layers, n_buckets)
    if free is None or need <= max(free, 0) / 2:  # the state fills as slots are written; a step grows beside it
        return
    gib = 2 ** 30
    # A window of many buckets is what makes the state large; with one (or none) it is the cache's size.
    name, fix = (("window", "set window_buckets (a few buckets of the window), a shorter window, or give vLLM a "
                  "smaller KV cache (VLLM_CPU_KVCACHE_SPACE)") if n_buckets > 1 else
                 ("kv_cache", "give vLLM a smaller KV cache (VLLM_CPU_KVCACHE_SPACE)"))
    raise Refusal(f"{name}: the plugin's per-slot state, a position and {n_buckets} float32 importance bucket(s) per "
                  f"slot and KV head, takes {need / gib:.1f} GiB for this engine's {slots:,}-slot KV cache over "
                  f"{layers} layers, more than half the {max(free, 0) / gib:.1f} GiB free beside it; {fix}")


def declared_kind(*configs, attn_type: str = "decoder") -> str | None:
    """The kind of attention, in words, that the model's configs (its config and its text config, any objects with
    transformers' attribute names) declare when it is not plain decoder self-attention, or None. ``attn_type`` is
    vLLM's (``ModelConfig.attn_type``), which names encoder-only pooling models that declare nothing themselves."""
    if attn_type == "encoder_only":
        return "encoder-only attention (bidirectional, no KV cache)"
    if attn_type == "encoder_decoder":
        return "an encoder-decoder model (encoder attention and cross-attention over the encoder's K/V)"
    for config in configs:
        if not getattr(config, "is_causal", True):
            return "encoder-only attention (is_causal: false; bidirectional, no KV cache)"
        if getattr(config, "is_encoder_decoder", False):
            return "an encoder-decoder model (encoder attention and cross-attention over the encoder's K/V)"
        if getattr(config, "attention_chunk_size", None):
            return (f"chunked local attention (attention_chunk_size: {config.attention_chunk_size}; each query "
                    f"attends within its chunk)")
        if getattr(config, "num_kv_shared_layers", 0):
            return (f"KV sharing (num_kv_shared_layers: {config.num_kv_shared_layers}; those layers read another "
                    f"layer's KV cache)")
    return None


def stand_in_windows(layer_types, sliding_window: int | None, budget: int) -> list[int] | None:
    """The window of each layer's cache spec as the plugin's worker reports it: ``budget`` for a full-attention layer
    (budgeted: a sliding window of the budget), ``sliding_window`` for a sliding one (kept native). None where the
    config gives no ``layer_types``, or a kind whose cache spec is not a window (left to the worker)."""
    if not layer_types:
        return None
    windows = []
    for kind in layer_types:
        if kind in FULL_ATTENTION:
            windows.append(budget)
        elif kind == "sliding_attention" and sliding_window:
            windows.append(sliding_window)
        else:
            return None
    return windows
