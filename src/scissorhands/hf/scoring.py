"""Exact teacher-forced scoring under a compressed cache.

Scoring a text as if it were streamed token by token through the budgeted
cache needs no decoding loop: one forward pass with a fresh
:class:`~scissorhands.hf.cache.ScissorhandsCache` does it. Each budgeted layer
computes its attention for all positions in blocks, one block per
compression event, with the eviction decided from that layer's own
probabilities; its outputs then feed the next layer. The log-probabilities
equal real decoding through the cache (the tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from scissorhands.core.methods import EvictionMethod, get_method
from scissorhands.core.planning.assembly import CachePlan
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.tokens.protect import Protection

from .cache import ScissorhandsCache, cache_plan, memory_shape
from .modelinfo import model_facts


@dataclass
class ScoreSetup:
    """A method at a token budget, on top of shared settings.

    Attributes
    ----------
    method : type of EvictionMethod
        A registered method class (see :func:`scissorhands.get_method`).
    budget : int or None
        Tokens per layer; None for no budget (the full cache).
    base : CacheSettings
        Shared settings; the method's own choices override them.
    seed : int
        For methods that draw random numbers.
    protect : tuple of (start, end), optional
        Token spans of the scored sequence that no layer evicts (see :mod:`scissorhands.core.tokens.protect`), e.g.
        the facts a retrieval task planted.
    """

    method: type[EvictionMethod]
    budget: int | None
    base: CacheSettings
    seed: int = 0
    protect: tuple[tuple[int, int], ...] | None = None
    #: The plan the budgeted cache is built from, when the caller planned it (a memory target's choice, or a
    #: budget turned into tokens for one sequence); None: planned from ``base`` and ``budget`` when built.
    plan: CachePlan | None = None

    @classmethod
    def planned(cls, made: CachePlan, method: type[EvictionMethod], seed: int = 0) -> ScoreSetup:
        """The setup of a cache a plan describes (:func:`scissorhands.hf.cache.cache_plan`): its budget and
        settings are the plan's, and the cache is built from it."""
        return cls(method, made.config.budget, made.config.settings, seed, plan=made)

    def cache_plan(self, model, total_length: int) -> CachePlan | None:
        """The plan of the cache :meth:`make_cache` builds for a sequence of ``total_length`` tokens; None for
        transformers' DynamicCache (nothing would be evicted: the budget covers the sequence, no head keeps less,
        and K/V are not packed)."""
        demoting = self.base.kv_demote is not None and not self.method.is_full and self.budget is not None
        # Head-level budgets evict from the streaming heads' window even when the budget covers the text.
        covered = self.budget is not None and self.budget >= total_length and self.base.head_budgets is None
        if not demoting and (self.method.is_full or self.budget is None or covered):
            if not self.base.quantized:
                return None
            # Nothing will be evicted: the full method's packed cache, whatever method was asked for, so that
            # settings tied to eviction (the residual's cap by the recent window) do not apply.
            return cache_plan(model, self.base, get_method("full")(), budget=1.0, length=total_length)  # it all
        # With demotion a budget above the length still demotes by its widths' shares: the cache as built.
        # The caller's plan holds while the budget and settings are its own (a task that changes them, as a
        # streamed prefill for a text scored whole, plans anew from them).
        planned = self.plan if self.plan is not None and (self.plan.config.budget, self.plan.config.settings) == (
            self.budget, self.base) else None
        if planned is not None and self.protect is None:
            return planned
        settings, method = ((planned.config, planned.method) if planned is not None else
                            (self.base, self.method(seed=self.seed)))
        return cache_plan(model, settings, method, budget=self.budget if planned is None else None,
                          protection=Protection.parse(None if self.protect is None else list(self.protect)))

    def make_cache(self, model, total_length: int):
        """A fresh cache for a sequence of ``total_length`` tokens, from :meth:`cache_plan`.

        When nothing would be evicted (the budget covers the sequence, and no head keeps less): transformers'
        DynamicCache, or, with packed K/V (``kv_bits`` < 16), a budgeted cache as large as the sequence.
        """
        made = self.cache_plan(model, total_length)
        return DynamicCache(config=model.config) if made is None else ScissorhandsCache.from_plan(model, made)

    def kv_bytes(self, model, total_length: int) -> float:
        """K/V bytes the cache :meth:`make_cache` builds holds at the end of a ``total_length``-token sequence,
        over the budgeted (full-attention) layers: the plan's byte model (:meth:`CachePlan.kv_bytes`), or the
        model's dtype per token for transformers' own cache."""
        made = self.cache_plan(model, total_length)
        if made is None:
            return total_length * model_facts(model).kv_bytes_per_token(next(model.parameters()).element_size())
        return made.kv_bytes(memory_shape(model), total_length)


def _gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) from logits (B, n, V) and targets (B, n), computed in float32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def token_logprobs(model, input_ids: torch.Tensor, setup: ScoreSetup,
                   cache=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and greedy hit of every token after the first, streamed through the cache.

    Parameters
    ----------
    input_ids : LongTensor, shape (T,) or (1, T)
    setup : ScoreSetup
    cache : Cache, optional
        A fresh cache from ``setup.make_cache`` (to read its memory report
        afterwards); by default one is made here.

    Returns
    -------
    logprobs : Tensor, shape (T - 1,), float32
        ``log p(x_t | x_<t)`` under the compressed cache.
    greedy : BoolTensor, shape (T - 1,)
        Whether ``x_t`` was the argmax prediction.
    """
    ids = input_ids.reshape(1, -1).to(model.device)
    if cache is None:
        cache = setup.make_cache(model, ids.shape[1])
    targets = ids[:, 1:]
    parts = _logit_head(model)
    if parts is None:  # a model whose logits are made in a way not known here: the whole window at once
        logits = model(ids, cache=cache).logits[:, :-1]  # (1, T-1, V)
        return _gather_logprobs(logits, targets)[0], (logits.argmax(-1) == targets)[0]
    decoder, head = parts
    hidden = decoder(input_ids=ids, cache=cache).last_hidden_state[:, :-1]  # (1, T-1, H)
    logprobs, greedy = [], []
    for start in range(0, hidden.shape[1], LOGIT_CHUNK):
        logits = head(hidden[:, start:start + LOGIT_CHUNK])
        part = targets[:, start:start + LOGIT_CHUNK]
        logprobs.append(_gather_logprobs(logits, part)[0])
        greedy.append((logits.argmax(-1) == part)[0])
    return torch.cat(logprobs), torch.cat(greedy)


LOGIT_CHUNK = 1024
"""Positions whose logits :func:`token_logprobs` makes at once. A window's logits are T x vocabulary floats
(10 GB for 16,384 tokens of a 152k vocabulary); in chunks the peak is this many rows."""

# Config fields through which some architectures scale their logits after the output projection. A model that
# has one is scored through its own forward, logits for the whole window at once.
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def _logit_head(model):
    """The model's decoder and its logits as one function of hidden states (output projection, then any final
    softcap), or None when the logits are made in a way not known here."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    project = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if project is None or decoder is model:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_SCALES):
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return decoder, project
    return decoder, lambda h: torch.tanh(project(h) / cap) * cap


@torch.no_grad()
def continuation_logprobs(model, context: list[int], continuations: list[list[int]],
                          setup: ScoreSetup) -> list[tuple[float, bool]]:
    """Score several continuations of one context, each streamed through the compressed cache.

    The context goes through the cache once; the cache is then copied per
    continuation (``batch_repeat_interleave``) and the continuations are fed as
    one right-padded chunk. This equals streaming each full sequence alone.

    Returns
    -------
    list of (sum of log-probs, all tokens greedy) per continuation
    """
    if not context:
        raise ValueError("context: is empty")
    n = len(continuations)
    longest = max(len(c) for c in continuations)
    if longest == 0:
        raise ValueError("continuation: is empty")
    device = model.device
    ctx = torch.tensor([context], device=device)
    cache = setup.make_cache(model, len(context) + longest)
    first = model(ctx, cache=cache, logits_to_keep=1).logits[:, -1:]  # (1, 1, V)
    cache.batch_repeat_interleave(n)
    conts = torch.zeros(n, longest, dtype=torch.long, device=device)
    mask = torch.zeros(n, len(context) + longest, dtype=torch.long, device=device)
    mask[:, : len(context)] = 1
    for i, c in enumerate(continuations):
        conts[i, : len(c)] = torch.tensor(c, device=device)
        mask[i, len(context): len(context) + len(c)] = 1
    positions = len(context) + torch.arange(longest, device=device).expand(n, -1)
    rest = model(conts, attention_mask=mask, cache=cache, position_ids=positions).logits  # (n, L, V)
    logits = torch.cat([first.expand(n, -1, -1), rest[:, :-1]], dim=1)  # (n, L, V): predicts conts
    lp = _gather_logprobs(logits, conts)
    hit = logits.argmax(-1) == conts
    out = []
    for i, c in enumerate(continuations):
        k = len(c)
        out.append((float(lp[i, :k].sum()), bool(hit[i, :k].all())))
    return out
