"""The eviction settings: what a layer keeps, and how it scores and drops the rest.

One group of :class:`~.config.CacheSettings` (the composite every entry point reads); each field is declared
once (:func:`~.declare.setting`) with its default, help, parse from text and check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import declare as s
from .declare import setting

IMPORTANCE_FORMS = ("sum", "count", "mean")
MEAN_CAP = 2048  # chosen by measurement at 2,048 to 16,384 tokens (docs/results.md, "A default at every length")


@dataclass(frozen=True)
class EvictionSettings:
    """Which tokens a full layer keeps: the recent window and sinks, the history window, the drop, the score."""

    # Chosen by measurement on SmolLM2-135M (docs/appendix/results_log.md, "Choosing the defaults by measurement").
    recent: int | float = setting(
        0.25, "the *r* most recently appended tokens are never evicted: a count, or a fraction of each layer's budget",
        s.parse_count_or_fraction, s.fraction_or_count(0, fraction_closed_low=True), metavar="R")
    sinks: int = setting(0, "the first *k* tokens of a sequence are never evicted", s.parse_int, s.integer(0),
                         metavar="K")
    window: int | None = setting(
        None, "history window *w* in steps; `None` = whole history (H2O)", s.parse_optional_int,
        s.integer(1, allow_none=True), metavar="W|none")
    window_buckets: int | None = setting(
        8, "accumulators per token per KV head representing the window; `None` = exact per-step window",
        s.parse_optional_int, s.integer(1, allow_none=True), metavar="N|none")
    drop: float | int = setting(
        0.05, "drop amount *m*: fraction of the layer budget (float) or token count (int)",
        s.parse_count_or_fraction, s.fraction_or_count(1, fraction_closed_low=False), metavar="M")
    rounds: bool = setting(
        False, "evict in rounds: a full layer chooses its `drop` lowest-scoring tokens at once, and they leave one "
        "per new token, oldest first (the layer stays at its budget, and scoring runs once per `drop` steps: the "
        "vLLM adapter's eviction, [below](#eviction-in-rounds))", s.parse_bool, s.boolean, switch=True)
    importance: str = setting(
        "mean", '`"sum"` of attention probabilities, `"count"` of queries where it exceeded 1/n, or `"mean"` '
        "(sum / queries in the window, counted up to `mean_cap`)", s.parse_text, s.one_of(IMPORTANCE_FORMS),
        metavar="|".join(IMPORTANCE_FORMS))
    mean_cap: int | None = setting(
        MEAN_CAP, '`importance="mean"` only: the queries a token\'s sum is divided by are counted up to this many, '
        "so a token scored by more is ranked by its sum; `None` = the plain mean (no other form reads it, so a grid "
        "may pass it to every method)", s.parse_optional_int, s.integer(1, allow_none=True), metavar="N|none")
    value_weighted: bool = setting(False, "multiply importance by the value norm", s.parse_bool, s.boolean,
                                   switch=True)
    merge: bool = setting(False, "fold evicted tokens into the most similar kept token instead of dropping them",
                          s.parse_bool, s.boolean, switch=True)

    def check(self) -> None:
        """The rules that tie this group's fields together (each field's own check is in its declaration)."""
        if self.rounds and self.merge:
            raise ValueError(f"rounds: cannot be combined with merge={self.merge!r}")

    @property
    def protected(self) -> int:
        """Tokens every layer must be able to keep whatever its budget: the sinks and a whole-token recent window."""
        return (self.recent if isinstance(self.recent, int) else 0) + self.sinks

    def recent_for(self, layer_budget: int) -> int:
        """The recent window of a layer with this budget."""
        return int(self.recent * layer_budget) if isinstance(self.recent, float) else int(self.recent)

    def bucket_steps(self) -> int | None:
        """Steps per importance bucket, or ``None`` for an unbounded window."""
        if self.window is None:
            return None
        n = self.window if self.window_buckets is None else min(self.window_buckets, self.window)
        return math.ceil(self.window / n)

    def n_buckets(self) -> int:
        """Number of importance accumulators kept per stored token and KV head."""
        steps = self.bucket_steps()
        return 1 if steps is None or self.window is None else math.ceil(self.window / steps)

    def drop_for(self, layer_budget: int, amount: float | int | None = None) -> int:
        """Drop amount for a layer with this budget (a fraction is rounded, then clamped)."""
        amount = self.drop if amount is None else amount
        m = max(1, round(amount * layer_budget)) if isinstance(amount, float) else int(amount)
        return max(1, min(m, layer_budget - self.recent_for(layer_budget) - self.sinks))
