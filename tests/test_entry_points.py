"""Every entry point builds the same cache from the same method and settings.

A method's own settings (TOVA's window of 1 and no recent window, H2O's summed
importance, ...) are applied by one resolver (``EvictionMethod.resolve``),
whichever way the cache is made: ``ScissorhandsCache(model, config, method)``,
the CLI's ``generate``, the exact scorer, ``eval``'s grid (its settings come from
the same flags, its cells from the scorer) and the lm-eval backend. The flags
below are chosen so that every method that fixes a setting overrides one of
them: a path that ignored the method's settings would show here.
"""

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import METHODS, get_method
from scissorhands.hf.scoring import ScoreSetup
from scissorhands.tools import cli
from scissorhands.tools.lm_eval_backend import ScissorhandsLM

BUDGET, LENGTH = 16, 40
FLAGS = {"recent": 5, "window": 12, "window_buckets": 4, "importance": "count", "drop": 3, "sinks": 1}
EVICTING = [name for name, cls in METHODS.items() if not cls.is_full]


class _Tokenizer(ByteTokenizer):
    """What the lm-eval backend reads of a tokenizer when it is built (no request is scored here)."""

    bos_token_id = None
    bos_token = None


def _cli_flags() -> list[str]:
    return [x for k, v in FLAGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _layers(cache) -> list[tuple]:
    """What each budgeted layer was built with: budget, recent window, drop, and its state's window."""
    out = []
    for layer in cache.budgeted_layers:
        state = layer.state
        out.append((layer.budget, layer.kv.recent, layer.kv.drop, type(state).__name__,
                    getattr(state, "form", None), getattr(state, "steps", None)))
    return out


def _built(cache) -> tuple:
    return cache.config, _layers(cache)


@pytest.mark.parametrize("name", EVICTING)
def test_every_entry_point_builds_the_same_cache(name):
    model = tiny_model("llama")
    method = get_method(name)
    python_api = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, **FLAGS), method())

    args = cli.build_parser().parse_args(["generate", "--budget", str(BUDGET), "--method", name, "--prompt", "x",
                                          *_cli_flags()])
    from_cli = ScissorhandsCache(model, cli.job(args).config, method())

    settings = ScissorhandsConfig(budget=BUDGET, **FLAGS).settings
    scorer = ScoreSetup(method, BUDGET, settings).make_cache(model, LENGTH)

    eval_args = cli.build_parser().parse_args(["eval", "--methods", name, "--budgets", str(BUDGET), *_cli_flags()])
    from_eval = ScoreSetup(method, BUDGET, cli.cache_settings(eval_args)).make_cache(model, LENGTH)

    lm = ScissorhandsLM(model=(model, _Tokenizer()), method=name, budget=BUDGET, **FLAGS)
    from_lm_eval = lm.setup_for(LENGTH).make_cache(model, LENGTH)

    want = _built(python_api)
    for label, cache in [("cli", from_cli), ("scorer", scorer), ("eval", from_eval), ("lm-eval", from_lm_eval)]:
        assert _built(cache) == want, label
    # The method's own settings won over the flags wherever it has any.
    for key, value in method.settings.items():
        assert getattr(python_api.config, key) == value


def test_a_method_overriding_a_given_value_says_so(caplog):
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="scissorhands.core.methods.base"):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, recent=8), get_method("tova")())
    assert cache.config.recent == 0 and cache.config.window == 1 and cache.config.importance == "sum"
    assert any("recent=0" in r.getMessage() and "recent=8" in r.getMessage() for r in caplog.records)


def test_the_same_settings_give_the_same_numbers_through_the_python_api_and_the_scorer():
    """Not only the same configuration: the same log-probabilities, for a method that overrides settings."""
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (LENGTH,), generator=torch.Generator().manual_seed(4))
    settings = ScissorhandsConfig(budget=BUDGET, **FLAGS).settings
    scorer = ScoreSetup(get_method("tova"), BUDGET, settings).make_cache(model, LENGTH)
    direct = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, **FLAGS), get_method("tova")())
    with torch.no_grad():
        a = model(ids[None], cache=scorer).logits
        b = model(ids[None], cache=direct).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", EVICTING)
def test_the_vllm_plugin_resolves_the_same_settings(name):
    """The plugin's settings object builds, through the same resolver, the config the transformers cache takes
    with the two settings the plugin fixes (eviction in rounds, the prompt held and evicted once)."""
    from scissorhands.vllm.settings import parse

    flags = dict(FLAGS)
    plugin = parse({"method": name, "budget": BUDGET, **{k: str(v) for k, v in flags.items()}})
    model = tiny_model("llama")
    direct = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, rounds=True, prefill="prompt-aware", **flags),
                               get_method(name)())
    assert plugin.method is get_method(name)
    assert plugin.config == direct.config


@pytest.mark.parametrize("name", ["scissorhands", "h2o", "tova"])
@pytest.mark.parametrize("memory", ["0.2", "0.1", "12KiB"])
def test_every_entry_point_makes_the_same_memory_choice(name, memory):
    """``memory=`` through the Python API, the CLI's generate, eval's grid and the lm-eval backend: one store,
    one token budget, one configuration (the method's own settings included)."""
    from scissorhands.core.planning.memory_target import parse_memory
    from scissorhands.tools.eval.runner import MemorySpec, _plan

    model = tiny_model("llama")
    method = get_method(name)
    length = 300
    python_api = ScissorhandsCache.for_memory(model, memory, length, ScissorhandsConfig(budget=16, **FLAGS).settings,
                                              method())
    args = cli.build_parser().parse_args(["generate", "--memory", memory, "--method", name, "--prompt", "x",
                                          *_cli_flags()])
    assert cli.job(args).config is None  # chosen once the model and the length are known, as run() does
    from_cli = cli.job(args).plan(model, length).memory_choice
    eval_args = cli.build_parser().parse_args(["eval", "--methods", name, "--memory", memory, *_cli_flags()])
    spec = MemorySpec(parse_memory(eval_args.memory))
    from_eval = _plan(model, spec, length, method, cli.cache_settings(eval_args)).memory_choice
    lm = ScissorhandsLM(model=(model, _Tokenizer()), method=name, memory=memory, **FLAGS)
    setup = lm.setup_for(length)
    want = python_api.memory_choice.config
    assert from_cli.config == want and from_eval.config == want
    from scissorhands.hf.cache import memory_shape

    # The plan's bytes are the ones its memory target planned with.
    assert python_api.plan.peak_bytes(memory_shape(model)) == python_api.memory_choice.peak_bytes
    assert (setup.budget, setup.base) == (want.budget, want.settings)
    assert _built(setup.make_cache(model, length)) == _built(python_api)


@pytest.mark.parametrize("name", ["scissorhands", "h2o", "tova"])
@pytest.mark.parametrize("budget,length", [(0.2, 300), (0.1, 300), (0.5, 37), (40, 300)])
def test_every_entry_point_turns_a_budget_into_the_same_tokens(name, budget, length):
    """A fraction (or a count) through the Python plan, the CLI's generate, eval's grid and the lm-eval backend:
    the plan's one rule makes it tokens (the method's own protected tokens + 1 the floor), and each builds the
    same layers."""
    from scissorhands.core.planning.assembly import budget_tokens
    from scissorhands.hf.cache import cache_plan
    from scissorhands.tools.eval.runner import _plan

    model = tiny_model("llama")
    method = get_method(name)
    settings = ScissorhandsConfig(budget=16, **FLAGS).settings
    python_api = cache_plan(model, settings, method(), budget=budget, length=length)
    tokens = max(round(budget * length) if budget < 1 else budget, method.resolve(settings).protected + 1)
    assert python_api.config.budget == budget_tokens(budget, length, settings, method) == tokens
    args = cli.build_parser().parse_args(["generate", "--budget", str(budget), "--method", name, "--prompt", "x",
                                          *_cli_flags()])
    from_cli = cli.job(args).plan(model, length)
    eval_args = cli.build_parser().parse_args(["eval", "--methods", name, "--budgets", str(budget), *_cli_flags()])
    from_eval = _plan(model, budget, length, method, cli.cache_settings(eval_args))
    lm = ScissorhandsLM(model=(model, _Tokenizer()), method=name, budget=budget, **FLAGS)
    from_lm_eval = lm.setup_for(length)
    assert from_cli.config == from_eval.config == python_api.config == from_lm_eval.plan.config
    want = _built(ScissorhandsCache.from_plan(model, python_api))
    for label, made in [("cli", from_cli), ("eval", from_eval), ("lm-eval", from_lm_eval.plan)]:
        assert _built(ScissorhandsCache.from_plan(model, made)) == want, label


def test_a_plan_refuses_a_fraction_without_a_length_and_a_budget_beside_a_memory_target():
    from scissorhands.hf.cache import cache_plan

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="^budget: a fraction"):
        cache_plan(model, ScissorhandsConfig(budget=16).settings, budget=0.5)
    with pytest.raises(ValueError, match="^memory: give memory or budget, not both"):
        cache_plan(model, ScissorhandsConfig(budget=16).settings, budget=32, memory=0.2, length=100)
    with pytest.raises(ValueError, match="^plan: must be a CachePlan"):
        ScissorhandsCache.from_plan(model, ScissorhandsConfig(budget=16))


def test_demotion_settings_are_the_same_through_every_entry_point_and_refused_by_vllm():
    """``kv_demote`` through the Python API, generate's flags, the scorer, eval's flags and lm-eval's arguments:
    one configuration and one chain of widths in every layer. vLLM keeps K/V in its own blocks and refuses it."""
    from scissorhands.vllm.settings import parse

    demote = {"kv_bits": 2, "kv_demote": "16:0.5,4:0.75", "kv_group_size": 8}
    flags = [*_cli_flags(), "--kv-bits", "2", "--kv-demote", "16:0.5,4:0.75", "--kv-group-size", "8"]
    model = tiny_model("llama")
    method = get_method("scissorhands")
    python_api = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, **FLAGS, **demote), method())
    args = cli.build_parser().parse_args(["generate", "--budget", str(BUDGET), "--prompt", "x", *flags])
    from_cli = ScissorhandsCache(model, cli.job(args).config, method())
    scorer = ScoreSetup(method, BUDGET, python_api.config.settings).make_cache(model, LENGTH)
    eval_args = cli.build_parser().parse_args(["eval", "--methods", "scissorhands", "--budgets", str(BUDGET), *flags])
    from_eval = ScoreSetup(method, BUDGET, cli.cache_settings(eval_args)).make_cache(model, LENGTH)
    lm = ScissorhandsLM(model=(model, _Tokenizer()), method="scissorhands", budget=BUDGET, **FLAGS,
                        **{k: str(v) for k, v in demote.items()})
    from_lm_eval = lm.setup_for(LENGTH).make_cache(model, LENGTH)

    def chain(cache):
        return [(layer.kv.tiers.tiers, layer.kv.tiers.tier_caps) for layer in cache.budgeted_layers]

    want = (_built(python_api), chain(python_api))
    assert want[1][0] == (((16, 0.5), (4, 0.75)), (8, 12))
    for label, cache in [("cli", from_cli), ("scorer", scorer), ("eval", from_eval), ("lm-eval", from_lm_eval)]:
        assert (_built(cache), chain(cache)) == want, label
    with pytest.raises(ValueError, match=r"^kv_demote: not supported by the vLLM adapter \(a setting of kv_store="):
        parse({"method": "scissorhands", "budget": BUDGET, "kv_demote": "4:0.5"})


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_static_decode_is_the_same_through_every_entry_point(decode):
    """``decode`` through the Python API, generate's flag, the scorer, eval's flag and lm-eval's argument: every
    budgeted layer gets the same step. vLLM runs its own step and refuses it (tests/core/test_decode_modes.py)."""
    model = tiny_model("llama")
    method = get_method("scissorhands")
    flags = [*_cli_flags(), "--decode", decode]
    python_api = ScissorhandsCache(model, ScissorhandsConfig(budget=BUDGET, decode=decode, **FLAGS), method())
    args = cli.build_parser().parse_args(["generate", "--budget", str(BUDGET), "--prompt", "x", *flags])
    from_cli = ScissorhandsCache(model, cli.job(args).config, method())
    scorer = ScoreSetup(method, BUDGET, python_api.config.settings).make_cache(model, LENGTH)
    eval_args = cli.build_parser().parse_args(["eval", "--methods", "scissorhands", "--budgets", str(BUDGET), *flags])
    from_eval = ScoreSetup(method, BUDGET, cli.cache_settings(eval_args)).make_cache(model, LENGTH)
    lm = ScissorhandsLM(model=(model, _Tokenizer()), method="scissorhands", budget=BUDGET, decode=decode, **FLAGS)
    from_lm_eval = lm.setup_for(LENGTH).make_cache(model, LENGTH)

    def steps(cache):
        return [None if layer.kv.static is None else layer.kv.static.mode for layer in cache.budgeted_layers]

    want = (_built(python_api), steps(python_api))
    assert want[1] == [decode, decode]
    for label, cache in [("cli", from_cli), ("scorer", scorer), ("eval", from_eval), ("lm-eval", from_lm_eval)]:
        assert (_built(cache), steps(cache)) == want, label


@pytest.mark.parametrize("name", ["scissorhands", "h2o"])  # TOVA protects 1 token: a budget of 1 is a fraction
def test_a_token_count_at_the_protected_tokens_is_refused_alike_by_every_entry_point(name):
    """One rule, the plan's (``check_budget``): a count must exceed the method's recent window and sinks; the
    command line, eval's grid, the lm-eval backend, the vLLM plugin and the plan refuse it in the same line."""
    from scissorhands.core.planning.assembly import check_budget
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.hf.cache import cache_plan
    from scissorhands.tools.cli.eval import _eval_budgets
    from scissorhands.vllm.settings import parse

    model = tiny_model("llama")
    eval_args = cli.build_parser().parse_args(["eval", "--methods", name, "--budgets", "0", *_cli_flags()])
    method = get_method(name)
    protected = method.resolve(CacheSettings(**FLAGS)).protected
    message = rf"^budgets?: a token count must be > recent \+ sinks \({protected}\), got {protected}"
    for attempt in (
        lambda: check_budget(protected, CacheSettings(**FLAGS), method),
        lambda: cache_plan(model, CacheSettings(**FLAGS), method(), budget=protected),
        lambda: _eval_budgets(setattr(eval_args, "budgets", str(protected)) or eval_args,
                              cli.cache_settings(eval_args), [method]),
        lambda: ScissorhandsLM(model=(model, _Tokenizer()), method=name, budget=protected, **FLAGS),
        lambda: parse({"method": name, "budget": protected, **{k: str(v) for k, v in FLAGS.items()}}),
    ):
        with pytest.raises(ValueError, match=message):
            attempt()
    assert check_budget(protected + 1, CacheSettings(**FLAGS), method) == protected + 1
