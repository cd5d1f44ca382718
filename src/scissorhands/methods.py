"""Eviction methods compared on one footing: same cache, same selection, same budget.

Every method is a :class:`~scissorhands.policy.EvictionPolicy` (how to score a
stored token) plus the window settings it implies. The cache layer does the
rest identically for all of them: the per-layer budget as a hard peak, the drop
amount, the recent window (for methods that have one), per-KV-head selection,
ties towards keeping the more recent token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import ScissorhandsConfig
from .policy import EvictionPolicy, ImportancePolicy


class PositionPolicy(EvictionPolicy):
    """Local window: the oldest token goes first."""

    name = "local"
    tracks_attention = False

    def scores(self, layer, length: int) -> torch.Tensor:
        return layer.positions[:, :, :length].to(torch.float32)


class SinkPolicy(EvictionPolicy):
    """StreamingLLM: the first ``sinks`` tokens (attention sinks) stay; otherwise the oldest goes first."""

    name = "streaming"
    tracks_attention = False

    def __init__(self, sinks: int = 4):
        self.sinks = sinks

    def scores(self, layer, length: int) -> torch.Tensor:
        pos = layer.positions[:, :, :length].to(torch.float32)
        return pos.masked_fill(pos < self.sinks, float("inf"))


class RandomPolicy(EvictionPolicy):
    """Random eviction, reproducible from ``seed``.

    Each compression draws fresh scores from a generator seeded by (seed,
    layer, compression count), so the draws do not depend on the order in
    which layers run: blocked prefill and token-by-token decoding agree.
    """

    name = "random"
    tracks_attention = False

    def __init__(self, seed: int = 0):
        self.seed = seed

    def scores(self, layer, length: int) -> torch.Tensor:
        shape = layer.positions[:, :, :length].shape
        gen = torch.Generator().manual_seed(hash((self.seed, layer.layer_idx, layer.compressions)) % 2**63)
        return torch.rand(shape, generator=gen).to(layer.positions.device)


@dataclass(frozen=True)
class Method:
    """A named eviction method.

    ``settings`` override fields of the base :class:`ScissorhandsConfig`
    (window, importance, recent): a method's defining choices win over the
    shared settings, so ``h2o`` always has an unbounded window and ``tova`` a
    one-step window. ``policy`` builds a fresh policy per cache.
    ``None`` as policy means the full cache (no eviction).
    """

    name: str
    description: str
    settings: tuple = ()
    policy: type | None = ImportancePolicy
    policy_args: tuple = ()

    def config(self, base: ScissorhandsConfig, budget: int) -> ScissorhandsConfig:
        return replace(base, budget=budget, **dict(self.settings))

    def make_policy(self, seed: int = 0) -> EvictionPolicy | None:
        if self.policy is None:
            return None
        if self.policy is RandomPolicy:
            return RandomPolicy(seed)
        return self.policy(*self.policy_args)

    @property
    def is_full(self) -> bool:
        return self.policy is None


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("full", "full cache, no eviction", policy=None),
        Method("scissorhands", "attention over the last w steps, in the configured importance form "
               "(default: summed probabilities)"),
        Method("scissorhands-count", "queries over the last w steps where attention exceeded 1/n",
               settings=(("importance", "count"),)),
        Method("h2o", "attention accumulated over the whole history (w = inf) + recent window",
               settings=(("importance", "sum"), ("window", None))),
        Method("tova", "the latest query's attention alone (w = 1), no recent window",
               settings=(("importance", "sum"), ("window", 1), ("recent", 0))),
        Method("streaming", "StreamingLLM: 4 attention-sink tokens + the most recent tokens",
               policy=SinkPolicy, policy_args=(4,)),
        Method("local", "the most recent tokens only", policy=PositionPolicy),
        Method("random", "random eviction (seeded) + recent window", policy=RandomPolicy),
    ]
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"methods: unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def resolve_budget(spec: float, length: int, recent: int) -> int:
    """Token budget for a sequence of ``length`` tokens.

    A spec up to 1 is a fraction of the sequence's own length (1 = no
    eviction); above 1 it is a token count. The budget never goes below
    ``recent + 1``.
    """
    if spec <= 0:
        raise ValueError(f"budgets: must be > 0, got {spec}")
    if spec > 1 and spec != int(spec):
        raise ValueError(f"budgets: a token count must be a whole number, got {spec}")
    tokens = round(spec * length) if spec <= 1 else int(spec)
    return max(tokens, recent + 1)
