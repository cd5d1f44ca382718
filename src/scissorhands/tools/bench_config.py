"""What ``scissorhands bench`` measures: its settings, validated, with no framework behind them.

Kept apart from the measuring (:mod:`.bench`) so the command line can take its defaults and checks from
here without loading a model library.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from scissorhands.core.settings.config import CacheSettings

PARTS = ("decode", "prefill", "maxbatch", "soak")
FIT_MODES = ("rss", "cache")


@dataclass(frozen=True)
class BenchConfig:
    """What ``scissorhands bench`` measures; every field is validated with a one-line ``ValueError``.

    Parameters
    ----------
    contexts : tuple of int
        Context lengths T for decode.
    batches : tuple of int
        Batch sizes for decode.
    budgets : tuple of float
        Budgets as fractions of the context, in (0, 1).
    steps, warmup : int
        Timed and untimed decode steps per variant.
    prefill_chunk : int
        Prompts are fed in chunks of this many tokens when building decode
        and max-batch caches (so a long prompt's activations stay bounded).
    prefill_contexts : tuple of int
        Prompt lengths for the prefill part (batch 1, one forward pass).
    repeats : int
        Prefill repeats (interleaved).
    memories : tuple
        Decode: memory budgets (``memory=``: fractions of the full cache's bytes, or sizes), each measured as a
        variant whose store and token budget are chosen for it, beside ``budgets``.
    cap_memory : int or None
        Memory cap in bytes for the max-batch search.
    fit : str
        ``"rss"``: a run fits when the process's peak RSS growth over the run
        is within the cap; ``"cache"``: when the cache's tensor bytes are.
    cap_prompt, cap_new, cap_limit : int
        Max batch: prompt tokens, new tokens, and the largest batch tried.
    soak_tokens, soak_budget, soak_every, soak_prompt : int
        Soak: tokens generated (0 = skip), token budget, record interval, prompt tokens.
    parts : tuple of str
        Which of ``decode``, ``prefill``, ``maxbatch``, ``soak`` to run.
    settings : CacheSettings
        How the budgeted cache evicts.
    seed : int
    methods : tuple of str
        Evicting methods measured beside the full cache.
    repeat_rows : bool
        Decode: prefill one prompt per variant and context, and give every batch size copies of its caches with
        that row repeated, instead of prefilling each batch's own prompts. A step costs the same either way (the
        shapes are equal), and a long context's prefill is paid once, not once per row and batch size.
    """

    contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    batches: tuple[int, ...] = (1, 8)
    budgets: tuple[float, ...] = (0.5, 0.2, 0.1)
    steps: int = 16
    warmup: int = 2
    prefill_chunk: int = 512
    prefill_contexts: tuple[int, ...] = (2048, 8192)
    repeats: int = 3
    memories: tuple = ()
    cap_memory: int | None = None
    fit: str = "rss"
    cap_prompt: int = 1024
    cap_new: int = 64
    cap_limit: int = 512
    soak_tokens: int = 0
    soak_budget: int = 256
    soak_every: int = 256
    soak_prompt: int = 128
    parts: tuple[str, ...] = ("decode", "prefill", "maxbatch", "soak")
    settings: CacheSettings = field(default_factory=CacheSettings)
    seed: int = 0
    methods: tuple[str, ...] = ("scissorhands",)
    repeat_rows: bool = False

    def __post_init__(self):
        if not self.methods:
            raise ValueError("methods: is empty")
        from scissorhands.core.methods import get_method  # imports torch; not at module level (--help)

        for name in self.methods:
            if get_method(name).is_full:
                raise ValueError("methods: 'full' is always measured (the full cache and the reference point); "
                                 "give evicting methods")
        for name, option in (("contexts", "seq-len"), ("batches", "batches"), ("prefill_contexts", "prefill-seq-len")):
            values = getattr(self, name)
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                given = ",".join(str(v) for v in values) or "(empty)"
                raise ValueError(f"{option}: must be a comma list of whole numbers >= 1, got {given}")
        if not self.budgets or any(not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0
                                   or (f >= 1 and f != int(f)) or f == 1 for f in self.budgets):
            given = ",".join(f"{f:g}" if isinstance(f, (int, float)) else repr(f) for f in self.budgets) or "(empty)"
            raise ValueError(f"budgets: must be a comma list of fractions in (0, 1) of each context or token counts "
                             f"(> 1), got {given}")
        for name, low in (("steps", 1), ("warmup", 0), ("prefill_chunk", 1), ("repeats", 1), ("cap_prompt", 1),
                          ("cap_new", 1), ("cap_limit", 1), ("soak_tokens", 0), ("soak_budget", 2),
                          ("soak_every", 1), ("soak_prompt", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name.replace('_', '-')}: must be a whole number >= {low}, got {value}")
        if self.cap_memory is not None and (not isinstance(self.cap_memory, int) or self.cap_memory <= 0):
            raise ValueError(f"cap-memory: must be a positive size such as 2GiB, got {self.cap_memory}")
        if not isinstance(self.repeat_rows, bool):
            raise ValueError(f"repeat-rows: must be true or false, got {self.repeat_rows!r}")
        if self.fit not in FIT_MODES:
            raise ValueError(f"fit: must be one of {', '.join(FIT_MODES)}, got {self.fit!r}")
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown or not self.parts:
            given = ",".join(self.parts) or "(empty)"
            raise ValueError(f"parts: must be a comma list of {', '.join(PARTS)}, got {given}")
        if "maxbatch" in self.parts and self.cap_memory is None:
            raise ValueError("cap-memory: the maxbatch part needs a cap, e.g. --cap-memory 2GiB")
        lead = self.steps + self.warmup
        for t in self.contexts:
            for f in self.budgets:
                if budget_tokens(f, t) <= lead:
                    raise ValueError(f"seq-len: at context {t} the budget {f:g} is {budget_tokens(f, t)} tokens, which "
                                     f"must exceed the warm-up + timed steps ({lead}), the reference point's decoding")

    def record(self) -> dict:
        """The config as JSON-ready fields."""
        out = asdict(self)
        out["settings"] = self.settings.as_dict()
        return out


def budget_tokens(spec: float, context: int) -> int:
    """A bench budget in tokens: a fraction (< 1) of the context, or a token count, by the plan's one rule
    (:func:`scissorhands.core.planning.assembly.budget_tokens`, at the default settings' floor)."""
    from scissorhands.core.planning.assembly import budget_tokens as tokens

    return tokens(spec if spec < 1 else int(spec), context, CacheSettings())


def parse_size(text: str, name: str = "cap-memory") -> int:
    """``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"300M"`` or plain bytes, as bytes; one-line ``ValueError`` else."""
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
             "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}
    s = text.strip().lower().replace(" ", "")
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{name}: must be a size such as 2GiB or 512MiB, got {text!r}") from None
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a positive size such as 2GiB or 512MiB, got {text!r}")
    return int(value * units[unit])
