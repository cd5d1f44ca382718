"""Perplexity with a chunked prompt-aware prefill (the prefill: tests/core/test_prompt_chunk.py)."""

from scissorhands import CacheSettings
from scissorhands.core.methods import get_method
from scissorhands.hf.scoring import ScoreSetup


def test_perplexity_keeps_a_chunked_prompt_aware_prefill_and_streams_a_held_one():
    """A text scored whole: the held prompt-aware prefill would hold it all (the full cache), so ppl streams
    it; a chunked one scores each chunk over what the chunks before it left, so it is kept."""
    from scissorhands.tools.eval.tasks import streamed

    method = get_method("scissorhands")
    held = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware"))
    chunked = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware", prompt_chunk=8))
    assert streamed(held).base.prefill == "stream"
    assert streamed(chunked).base == chunked.base
    # prompt-aware's own settings leave with it: a streamed prefill does not take them
    observed = ScoreSetup(method, 16, CacheSettings(prefill="prompt-aware", observe=4, pool=3))
    assert streamed(observed).base == CacheSettings(prefill="stream")
