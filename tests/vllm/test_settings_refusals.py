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
