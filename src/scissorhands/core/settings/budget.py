"""A budget as users give it, and the one place it becomes a token count.

A *budget spec* is either a fraction of each sequence's own length (a number
in (0, 1]; 1 means no eviction) or a token count (a whole number > 1).
Callers that do not know the sequence yet keep the spec and resolve it per
sequence; nobody invents a placeholder budget.
"""

from __future__ import annotations

import math
import numbers


def check_budget_spec(spec, name: str = "budget") -> float | int:
    """Validate a budget spec; return it as an ``int`` (token count) or ``float`` (fraction).

    Raises
    ------
    ValueError
        ``"<name>: ..."``, for anything that is not a finite positive number, or
        a token count that is not whole.
    """
    if isinstance(spec, bool) or not isinstance(spec, numbers.Real):
        raise ValueError(f"{name}: must be a fraction in (0, 1] or a token count, got {spec!r}")
    value = float(spec)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a fraction in (0, 1] or a token count > 1, got {spec}")
    if value > 1:
        if value != int(value):
            raise ValueError(f"{name}: a token count (> 1) must be a whole number, got {spec}")
        return int(value)
    return value


def resolve_budget(spec, length: int, recent: int, name: str = "budget") -> int:
    """Token budget for a sequence of ``length`` tokens.

    A fraction is rounded to tokens of this sequence; a count is used as is.
    ``recent`` is the number of tokens a layer always keeps (the recent window
    and the sinks, ``CacheSettings.protected``). The result never goes below
    ``recent + 1``, the smallest budget that leaves room for one token beside them (short sequences at a small
    fraction hit this floor; their compression is then below the nominal one,
    and the evaluation records the budget actually used).
    """
    value = check_budget_spec(spec, name)
    tokens = round(value * length) if isinstance(value, float) else value
    return max(tokens, recent + 1)
