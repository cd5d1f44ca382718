"""Command-line pieces every subcommand shares: one parser style, the model and cache flags, old spellings.

Every option is parsed by argparse with a typed converter (so a bad value is argparse's one line, naming the
option) and checked by the dataclass it fills (its ``__post_init__``, naming the option too). The cache
flags are generated from the settings' declarations; the model flags are one function.
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.declare import declared, parse_count_or_fraction, parse_float, parse_int
from scissorhands.core.settings.names import method_names


class _Deprecated(argparse.Action):
    """An old option name: stores into the new option's destination and says, once, what to use instead."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"scissorhands: warning: {option_string} is deprecated; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def alias(group, old: str, new: str, dest: str) -> None:
    """Accept ``old`` for the option ``new`` (destination ``dest``, same parsing), hidden from ``--help``."""
    kind = group._option_string_actions[new].type  # argparse keeps its options there
    group.add_argument(old, dest=dest, action=_Deprecated, new=new, type=kind, help=argparse.SUPPRESS)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def arg_type(parse):
    """An argparse type from a declared parser: its ValueError becomes argparse's one-line error."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        return value

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _plain(text: str) -> str:
    """A declaration's help without its markdown (the docs render it; a terminal does not)."""
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)
    return text.replace("`", "").replace("*", "")


def add_cache_args(p: argparse.ArgumentParser, budget_default: int | None = None, with_budget: bool = True) -> None:
    """One flag per declared cache setting (:mod:`scissorhands.core.settings.declare`): help, type and default.

    A flag that is not given is absent from the namespace, so only what the user typed overrides the preset
    (or the library defaults).
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    g = groups["eviction"] = p.add_argument_group("eviction")
    if with_budget:
        shown = "" if budget_default is None else f" (default {budget_default})"
        g.add_argument("--budget", type=arg_type(parse_count_or_fraction), default=None, metavar="B",
                       help="average tokens stored per full-attention layer (a hard peak per layer): a token count "
                       "(> 1), or a fraction (<= 1) of the prompt plus --max-new-tokens, as in eval's --budgets"
                       f"{shown}; or give --memory")
        g.add_argument("--memory", default=None, metavar="M",
                       help="a memory budget instead of --budget: a fraction of the full cache's K/V bytes (0.2 = "
                       "a fifth) or a size per sequence (64MiB); the store's bits, residual and token budget are "
                       "chosen for it from measurements, and the choice is printed")
        p.set_defaults(budget_fallback=budget_default)
        g.add_argument("--method", default="scissorhands", help=f"eviction method: {method_names()}")
    for name, default, decl in declared(CacheSettings):
        g = groups.get(decl.group) or groups.setdefault(decl.group, p.add_argument_group(decl.group))
        flag = "--" + name.replace("_", "-")
        text = f"{_plain(decl.help)} (default {default})"
        if decl.switch:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(flag, type=arg_type(decl.parse), default=argparse.SUPPRESS, metavar=decl.metavar,
                           help=text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded default), a Hugging Face id, a folder or a .gguf file")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps (default cpu)")


def option(group, flag: str, kind, default, text: str, **kwargs) -> None:
    """A typed option whose help ends with its default (a list shown as ``1,8``)."""
    shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default) \
        if isinstance(default, tuple) else default
    group.add_argument(flag, type=kind, default=default, help=f"{text} (default {shown})", **kwargs)


def whole_list(text: str) -> tuple[int, ...]:
    """A comma list of whole numbers (``"1024,2048"``)."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError("is empty")
    return tuple(parse_int(x) for x in items)


def number_list(text: str) -> tuple[float, ...]:
    """A comma list of numbers (``"0.5,0.2"``)."""
    items = [x for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError("is empty")
    return tuple(parse_float(x) for x in items)


def name_list(text: str) -> tuple[str, ...]:
    """A comma list of names (``"decode,prefill"``)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


WHOLE = arg_type(parse_int)
FLOAT = arg_type(parse_float)
WHOLES = arg_type(whole_list)
NUMBERS = arg_type(number_list)
NAMES = arg_type(name_list)
