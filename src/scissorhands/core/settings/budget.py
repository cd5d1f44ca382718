"""A budget as users give it.

A *budget spec* is either a fraction of each sequence's own length (a number
in (0, 1]; 1 means no eviction) or a token count (a whole number > 1).
Callers that do not know the sequence yet keep the spec; the plan turns it into tokens per sequence
(:func:`scissorhands.core.planning.assembly.budget_tokens`, the one place); nobody invents a placeholder budget.
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
