"""The prefill settings: how a layer takes a prompt (the modes are :mod:`scissorhands.core.attend.prefill`).

One group of :class:`~.config.CacheSettings` (the mode), and the settings each shipped mode owns
(:class:`StreamedSettings`, :class:`PromptAwareSettings`, each valid only with its mode: :func:`~.declare.own`). Like
every group they live in this wing, below the modes they configure, and import no torch, so ``--help`` reads
them in a moment; a mode registered from outside declares its own settings beside its class instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import declare as s
from .declare import setting

# The shipped modes; any registered one is taken (attend/prefill.py).
PREFILL_MODES = ("stream", "prompt-aware", "keep-prompt")
GROUP = "prefill"


_prefill_name = s.registered("prefill", PREFILL_MODES, "prefill mode")


def _odd(name, value):
    value = s.integer(1)(name, value)
    if value % 2 == 0:
        raise ValueError(f"{name}: must be odd (the pooled slot sits in the middle), got {value}")
    return value


@dataclass(frozen=True)
class PrefillSettings:
    """How a prompt enters a layer: the mode (each mode owns its own settings, below)."""

    prefill: str = setting(
        "stream", '`"stream"` (peak = budget; in rounds, + one round inside a chunk), `"prompt-aware"` (hold the '
        'prompt once, score it by its last queries) or `"keep-prompt"` (keep the prompt, or `prompt_keep` of it, '
        'beside a budget for the generated tokens)',
        s.parse_text, _prefill_name, group=GROUP, metavar="|".join(PREFILL_MODES))


@dataclass(frozen=True)
class StreamedSettings:
    """The setting of the streamed prefill (:class:`~scissorhands.core.attend.prefill.Streamed`), which owns it:
    valid only with ``prefill="stream"`` (or a registered mode built on it)."""

    prefill_drop: float | int | None = setting(
        None, "streamed prefill: tokens evicted at each compression event of a chunk of several tokens (a "
        "fraction of the layer budget, or a count); `None` = `drop`, which makes a chunk exactly token-by-token "
        "decoding. Larger means fewer, cheaper events; the peak stays the budget (in rounds, + one round)",
        s.parse_optional_count_or_fraction, s.fraction_or_count(1, fraction_closed_low=False, allow_none=True),
        metavar="M|none")


@dataclass(frozen=True)
class JudgedSettings:
    """How a held prompt is judged by its last queries: the settings the prompt-aware and keep-prompt prefills
    share (one declaration each, so a value given is valid with either mode)."""

    observe: int = setting(32, "prompt-aware prefill: how many of the prompt's last queries score it", s.parse_int,
                           s.integer(1), group=GROUP, metavar="N")
    pool: int = setting(7, "prompt-aware prefill: max-pool width over neighbouring slots (odd), so a fact spanning "
                        "several tokens stays whole; 1 = none", s.parse_int, _odd, group=GROUP, metavar="N")


@dataclass(frozen=True)
class PromptAwareSettings(JudgedSettings):
    """The settings of the prompt-aware prefill (:class:`~scissorhands.core.attend.prefill.PromptAware`), which
    owns them: they are valid only with ``prefill="prompt-aware"`` (:func:`~.declare.own`; ``observe`` and
    ``pool`` with ``prefill="keep-prompt"`` too)."""

    prompt_chunk: int | None = setting(
        None, "prompt-aware prefill: take the prompt this many tokens at a time, each chunk held beside the budget "
        "and evicted back to it by its own last queries, so the peak is budget + chunk; `None` = the whole prompt "
        "at once (peak = the prompt)", s.parse_optional_int, s.integer(1, allow_none=True), group=GROUP,
        metavar="C|none")


@dataclass(frozen=True)
class KeepPromptSettings(JudgedSettings):
    """The settings of the kept-prompt prefill (:class:`~scissorhands.core.attend.prefill.KeepPrompt`): the
    prompt-aware prefill's judgement (``observe``, ``pool``), and how much of the prompt is kept beside the
    budget, which then holds the generated tokens alone."""

    prompt_keep: float | int | None = setting(
        None, "keep-prompt prefill: how much of each prompt is kept, beside the budget, until the sequence ends: "
        "a fraction of the prompt or a count of its tokens, chosen by its last queries; `None` = the whole prompt. "
        "The budget then holds the generated tokens alone", s.parse_optional_count_or_fraction,
        s.fraction_or_count(1, fraction_closed_low=False, allow_none=True), group=GROUP, metavar="F|N|none")


s.own("prefill", "stream", StreamedSettings)
s.own("prefill", "prompt-aware", PromptAwareSettings)
s.own("prefill", "keep-prompt", KeepPromptSettings)
