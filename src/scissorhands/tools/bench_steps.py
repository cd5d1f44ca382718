"""The steps every part of the bench times: a cache for a variant, seeded tokens, one forward, a prefill."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import DynamicCache

from scissorhands.core.methods import get_method
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.hf.cache import ScissorhandsCache
from scissorhands.hf.modelinfo import text_config

CHUNKED = "prompt-aware, chunked"  # the prefill part's name for prompt-aware with the settings' prompt_chunk


def make_cache(model, budget: int | None, settings: CacheSettings, prefill: str | None = None,
                method: str = "scissorhands", chosen: dict | None = None):
    if budget is None:
        return DynamicCache(config=model.config)
    config = settings.with_budget(budget) if chosen is None else ScissorhandsConfig(budget=budget, **chosen)
    if prefill is not None:  # a mode named by the prefill part: the held prompt-aware prefill unless chunked
        chunked = prefill == CHUNKED
        config = replace(config.with_plugin("prefill", "prompt-aware" if chunked else prefill),
                         prompt_chunk=config.prompt_chunk if chunked else None)
    return ScissorhandsCache(model, config, get_method(method)())


def tokens(model, batch: int, length: int, seed: int) -> torch.Tensor:
    """Token ids (B, length): seeded, away from the special ids at the start of the vocabulary."""
    vocab = text_config(model).vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(16, vocab - 1), vocab, (batch, length), generator=gen).to(model.device)


def forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """One forward over ``ids`` through ``cache``; the next token per row (greedy).

    On an accelerator it waits for the queued work, so that wall-clock timings cover it.
    """
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
    if nxt.device.type == "cuda":
        torch.cuda.synchronize(nxt.device)
    return nxt


def prefill(model, ids: torch.Tensor, cache, chunk: int | None) -> torch.Tensor:
    step = ids.shape[1] if chunk is None else chunk
    nxt = None
    for start in range(0, ids.shape[1], step):
        nxt = forward(model, ids[:, start:start + step], cache)
    assert nxt is not None
    return nxt
