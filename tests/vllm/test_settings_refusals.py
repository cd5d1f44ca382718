"""The vLLM adapter's settings refuse, in one line, what the core offers and the adapter cannot serve (the static
decode step, a chunked prompt). The core's own tests name no adapter; tests/vllm holds the adapter's others."""

import pytest


def test_vllm_refuses_static_decode():
    from scissorhands.vllm.settings import parse

    with pytest.raises(ValueError, match=r"^decode: not supported by the vLLM adapter"):
        parse({"method": "scissorhands", "budget": 16, "decode": "static"})


def test_vllm_refuses_prompt_chunk():
    from scissorhands.vllm.settings import parse

    with pytest.raises(ValueError, match=r"^prompt_chunk: not supported by the vLLM adapter"):
        parse({"method": "scissorhands", "budget": 16, "prompt_chunk": "64"})
    # the increasing schedule's own setting: refused as the schedule is, not as a setting of an unchosen one
    with pytest.raises(ValueError, match=r"^increasing_slope: not supported by the vLLM adapter"):
        parse({"method": "scissorhands", "budget": 16, "increasing_slope": "0.3"})
    with pytest.raises(ValueError, match=r"^prefill_drop: a setting of prefill='stream', got prefill='prompt-aware'$"):
        parse({"method": "scissorhands", "budget": 16, "prefill_drop": "4"})


def test_the_paper_preset_runs_through_the_adapter_and_a_residual_of_tokens_is_refused():
    """``preset="paper"`` sets ``kv_residual=0`` (no token kept apart at full precision), which asks nothing of the
    adapter (K/V in vLLM's blocks are never packed): the evaluation's settings for the preset parse, with the
    preset's window, recent tokens, drop and summed importance; a residual of some tokens is still refused."""
    from scissorhands.core.methods import get_method
    from scissorhands.core.settings.config import CacheSettings
    from scissorhands.tools.eval.engine import plugin_settings
    from scissorhands.vllm.settings import parse

    base = CacheSettings(preset="paper", rounds=True)
    given = plugin_settings(get_method("scissorhands"), 190, base)
    assert given["kv_residual"] == 0
    config = parse(given).config
    assert (config.window, config.recent, config.importance, config.budget) == (400, 10, "sum", 190)
    assert config.drop == parse({"method": "scissorhands", "budget": 190, "drop": 0.4}).config.drop
    with pytest.raises(ValueError, match=r"^kv_residual: not supported by the vLLM adapter .*got 64$"):
        parse({"method": "scissorhands", "budget": 16, "kv_residual": "64"})
