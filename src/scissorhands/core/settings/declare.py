"""How a setting is declared: once, with its default, its help, its parsing from text and its check.

Every field of :class:`~scissorhands.core.settings.config.CacheSettings` is made with
:func:`setting`. What reads settings derives everything from those
declarations: the dataclass validates each field with its ``check``, the CLI
builds one flag per field (help, metavar and parsing included), the lm-eval
backend and the vLLM adapter parse their ``key=value`` strings with ``parse``,
and docs/usage.md's settings table is :func:`settings_table` (a test compares them).

A ``check`` takes ``(name, value)`` and returns the value (normalised, e.g. a
list made a tuple) or raises ``ValueError("<name>: ...")``. A ``parse`` takes
text and returns a value, or raises ``ValueError`` with the reason only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

Check = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Setting:
    """One field's declaration (kept in the dataclass field's ``metadata["setting"]``)."""

    help: str
    parse: Callable[[str], Any]
    check: Check
    group: str = "eviction"
    metavar: str | None = None
    switch: bool = False  # a boolean: ``--name`` / ``--no-name`` on the command line


def setting(default, help: str, parse: Callable[[str], Any], check: Check, *, group: str = "eviction",
            metavar: str | None = None, switch: bool = False) -> Any:
    """A dataclass field declared with everything the entry points derive from it (``default=REQUIRED``: none)."""
    meta = {"setting": Setting(help, parse, check, group, metavar, switch)}
    return field(metadata=meta) if default is REQUIRED else field(default=default, metadata=meta)


REQUIRED: Any = MISSING
"""The default of a setting that must be given (the budget)."""


def declared(cls) -> list[tuple[str, Any, Setting]]:
    """``(name, default, declaration)`` of every declared setting of a settings dataclass, in order.

    A required field's default is :data:`REQUIRED`. A class with ``plugin_axes`` (the cache's settings) also
    lists the settings its plug-ins own (:func:`own`), each after the field its axis names.
    """
    rows = _fields(cls)
    axes: dict[str, str] = getattr(cls, "plugin_axes", {})
    if not axes or not OWNED:
        return rows
    out = []
    for row in rows:
        out.append(row)
        out += [(name, o.default, o.decl) for name, o in OWNED.items() if axes.get(o.axis) == row[0]]
    return out


def _fields(cls) -> list[tuple[str, Any, Setting]]:
    return [(f.name, f.default, f.metadata["setting"]) for f in fields(cls) if "setting" in f.metadata]


def validate(obj) -> None:
    """Run every field's own check on a (frozen) settings dataclass, storing normalised values."""
    for name, _, decl in _fields(type(obj)):
        object.__setattr__(obj, name, decl.check(name, getattr(obj, name)))


# -- settings a plug-in owns ----------------------------------------------------------------------------------
@dataclass
class Owned:
    """A setting that belongs to plug-ins of one axis (a prefill mode, a store), not to the shared settings."""

    axis: str  # the field that names the plug-in: "prefill", "kv_store"
    decl: Setting
    default: Any
    owners: set[str] = field(default_factory=set)  # the plug-ins' names (several when they share a declaration)


OWNED: dict[str, Owned] = {}
"""Every plug-in-owned setting by name, while its plug-ins are registered."""

PLUGIN_SETTINGS: dict[tuple[str, str], type] = {}
"""The dataclass of each plug-in's own settings, by (axis, plug-in name): whose ``check`` runs when it is chosen."""

RESERVED: set[str] = set()
"""Names a plug-in's setting may not take (the shared settings'; filled by the settings' composition)."""

NAMES: dict[str, list[str]] = {}
"""The plug-ins registered on each axis ("method", "prefill", "decode", "kv_store"), in registration order, kept
here by their registries (:class:`scissorhands.core.registry.Registry`): the settings and the help texts read the
names without importing the plug-ins, which import torch. An axis is absent until its registry exists."""


def named(axis: str, shipped: tuple[str, ...]) -> tuple[str, ...]:
    """The plug-in names ``axis`` takes: those registered, or, until its registry is loaded, the ``shipped``
    ones (which it registers as it loads)."""
    names = NAMES.get(axis)
    return shipped if names is None else tuple(names)


def own(axis: str, owner: str, cls) -> None:
    """Declare the settings of the plug-in ``owner`` on ``axis``: the :func:`setting` fields of the frozen
    dataclass ``cls``, which may also define ``check(self)`` for the rules among them.

    They become settings like the shared ones (keyword arguments of the cache's settings, read as attributes,
    flags of the command line, lm-eval and vLLM keys), valid only while ``axis`` names ``owner``. A registry
    calls this when a plug-in that has ``Settings`` registers; two plug-ins may share one dataclass, or one's
    may subclass the other's (the tiered store's adds ``kv_demote`` to the packed store's).
    """
    rows = _fields(cls)
    for name, default, decl in rows:
        have = OWNED.get(name)
        if name in RESERVED or (have is not None and (have.decl is not decl or have.axis != axis)):
            whose = "a name of the shared settings" if have is None else \
                f"a setting of {have.axis}=" + " or ".join(repr(o) for o in sorted(have.owners))
            raise ValueError(f"{name}: already {whose}; {owner!r} must name its setting otherwise")
        if default is REQUIRED:
            raise ValueError(f"{name}: a plug-in's setting needs a default ({owner!r})")
    for name, default, decl in rows:
        OWNED.setdefault(name, Owned(axis, decl, default)).owners.add(owner)
    PLUGIN_SETTINGS[(axis, owner)] = cls


def disown(axis: str, owner: str) -> None:
    """Forget what :func:`own` declared for ``owner`` (its plug-in is unregistered)."""
    PLUGIN_SETTINGS.pop((axis, owner), None)
    for name in [n for n, o in OWNED.items() if o.axis == axis]:
        OWNED[name].owners.discard(owner)
        if not OWNED[name].owners:
            del OWNED[name]


def check_owned(obj, given: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """Plug-in settings given to ``obj`` (the cache's settings) checked, those at their default left out.

    Each value passes its declaration's check; a value other than the default needs its plug-in chosen
    (``obj.plugin(axis, given)``: the axis names it, or for the store, implies it); then each chosen plug-in's
    own ``check`` runs over its settings.
    """
    checked = {}
    for name, value in given:
        o = OWNED.get(name)
        if o is None:
            raise ValueError(f"{name}: unknown setting (its plug-in is not registered)")
        value = o.decl.check(name, value)
        if value != o.default:
            checked[name] = value
    out = {}
    for name, value in checked.items():
        o = OWNED[name]
        chosen = obj.plugin(o.axis, checked)
        if chosen not in o.owners:
            whose = " or ".join(repr(n) for n in sorted(o.owners))
            got = f"{o.axis}={chosen!r}" if getattr(obj, o.axis) == chosen else \
                f"{o.axis}={getattr(obj, o.axis)!r}, which is {chosen!r} with these settings"
            raise ValueError(f"{name}: a setting of {o.axis}={whose}, got {got}")
        out[name] = value
    for (axis, owner), cls in PLUGIN_SETTINGS.items():
        if hasattr(cls, "check") and obj.plugin(axis, out) == owner:
            cls(**{n: out.get(n, d) for n, d, _ in _fields(cls)}).check()
    return tuple(sorted(out.items()))


def from_strings(cls, given: dict[str, Any], what: str = "setting") -> dict[str, Any]:
    """Parse ``key=value`` pairs (values as text or already typed) into field values of ``cls``.

    Unknown keys and unparsable text are a ``ValueError`` naming the key.
    """
    decls = {name: decl for name, _, decl in declared(cls)}
    out = {}
    for key, value in given.items():
        if key not in decls:
            raise ValueError(f"{key}: unknown {what}; known: {', '.join(decls)}")
        if isinstance(value, str):
            try:
                value = decls[key].parse(value)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        out[key] = value
    return out


def settings_table(rows: Sequence[tuple[str, Any, Setting]]) -> str:
    """Markdown table of declared fields: name, default, meaning (docs/usage.md's table is this)."""
    lines = ["| field | default | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {show(default)} | {decl.help} |" for name, default, decl in rows]
    return "\n".join(lines)


def show(value) -> str:
    """A default as the table prints it."""
    if value is REQUIRED:
        return "—"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value}`"


# -- parsers: text -> value (the reason only in errors; callers name the setting) -----------------------------
NONE_WORDS = ("none", "null", "inf", "all")


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"must be a whole number, got {text!r}") from None


def parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"must be a number, got {text!r}") from None


def parse_optional_int(text: str) -> int | None:
    return None if text.strip().lower() in NONE_WORDS else parse_int(text)


def parse_count_or_fraction(text: str) -> int | float:
    """``"10"`` is a token count, ``"0.25"`` a fraction."""
    t = text.strip()
    return parse_float(t) if any(c in t for c in ".eE") else parse_int(t)


def parse_optional_count_or_fraction(text: str) -> int | float | None:
    return None if text.strip().lower() in ("none", "null") else parse_count_or_fraction(text)


def parse_text(text: str) -> str:
    return text.strip()


def parse_optional_text(text: str) -> str | None:
    return None if text.strip().lower() in ("none", "null", "") else text.strip()


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("true", "1", "yes", "on"):
        return True
    if t in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def parse_schedule(text: str):
    """A name, a comma list of per-layer budgets, or a JSON file."""
    t = text.strip()
    if "," in t or t.isdigit():
        try:
            return tuple(int(x) for x in t.split(","))
        except ValueError:
            raise ValueError(f"bad budget list {text!r}") from None
    return t


# -- checks: (name, value) -> value, or ValueError naming the setting ----------------------------------------
def integer(low: int, *, allow_none: bool = False, choices: tuple[int, ...] | None = None) -> Check:
    """An integer >= ``low``, optionally one of ``choices``; a float, even an integral one, is refused."""

    def check(name, value):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}: must be an integer{' or None' if allow_none else ''}, got {value!r}")
        if choices is not None and value not in choices:
            raise ValueError(f"{name}: must be one of {_listed(choices, allow_none)}, got {value!r}")
        if value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
        return int(value)

    return check


def fraction_or_count(low_count: int, fraction_closed_low: bool, allow_none: bool = False) -> Check:
    """A fraction (a float in [0, 1) or (0, 1)) or a token count (an integer >= ``low_count``), or None if allowed."""

    def check(name, value):
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float)):
            raise ValueError(f"{name}: must be a fraction or a token count, got {value!r}")
        if isinstance(value, float):
            ok = (0.0 <= value < 1.0) if fraction_closed_low else (0.0 < value < 1.0)
            if not ok:
                span = "[0, 1)" if fraction_closed_low else "(0, 1)"
                raise ValueError(f"{name}: a fraction must be in {span}, got {value}")
            return value
        return integer(low_count)(name, value)

    return check


def real(low: float, high: float) -> Check:
    """A finite number in [low, high)."""

    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{name}: must be a finite number, got {value!r}")
        if not low <= value < high:
            raise ValueError(f"{name}: must be in [{low}, {high}), got {value}")
        return float(value)

    return check


def _listed(choices: tuple, allow_none: bool) -> str:
    """``2, 4, 8, 16 or None`` / ``'mean', 'sum' or 'count'``: the choices as a reader writes them."""
    words = [repr(c) if isinstance(c, str) else str(c) for c in choices] + (["None"] if allow_none else [])
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def one_of(choices: tuple, allow_none: bool = False) -> Check:
    def check(name, value):
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}: must be one of {_listed(choices, allow_none)}, got {value!r}")
        return value

    return check


def registered(axis: str, shipped: tuple[str, ...], what: str, allow_none: bool = False) -> Check:
    """A name registered on ``axis`` (prefill modes, decode modes, stores): :func:`named`."""

    def check(name, value):
        if value is None and allow_none:
            return None
        names = named(axis, shipped)
        if not isinstance(value, str) or value not in names:
            none = " or None" if allow_none else ""
            raise ValueError(f"{name}: must be a registered {what} ({', '.join(names)}){none}, got {value!r}")
        return value

    return check


def boolean(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be True or False, got {value!r}")
    return value


def optional_path(name, value):
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: must be a file path, got {value!r}")
    return value
