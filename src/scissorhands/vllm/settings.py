"""The plugin's settings: where they come from, what the vLLM adapter supports, and the one config they build.

They are read from vLLM's ``additional_config`` under the key ``"scissorhands"``
(``--additional-config '{"scissorhands": {"budget": 256}}'`` or
``LLM(additional_config=...)``), or from the environment variable
``SCISSORHANDS_VLLM`` holding the same JSON object. Without either, the plugin
is installed but off, and vLLM runs exactly as without it.

The keys are ``method``, ``budget`` (tokens per layer and KV head),
``protect_prefix`` (the first N tokens of every prompt are never evicted: they
stay where vLLM wrote them, beside a window of the rest of the budget, so with
vLLM's prefix caching a shared system prompt's whole blocks are shared) and
every setting of :class:`~scissorhands.core.settings.config.CacheSettings` (a registered plug-in's own too), parsed and
checked by its declaration, as the CLI and the lm-eval backend do. The same
method and settings give the same configuration here as through
``ScissorhandsCache(model, config, method)`` (a test holds the two equal).

What the adapter fixes, and why (each given otherwise is a one-line error):

* ``rounds`` is on (:mod:`scissorhands.core.tokens.rounds`): the layer is presented
  to vLLM as a sliding window of ``budget`` slots, which frees each block as
  soon as it is behind the window; a slot inside the window is always attended,
  so a full layer holds exactly ``budget`` tokens, and every ``drop`` steps it
  chooses ``drop`` victims and swaps them into the slots that leave the window
  next (``drop`` is the library's, 5% of the budget by default);
* ``prefill`` is ``"prompt-aware"`` (the default here) or ``"stream"``: vLLM holds
  the whole prompt's blocks while it is prefilled whatever the mode, so streaming
  buys no memory; the prompt-aware prefill attends the held prompt exactly and
  evicts it to the budget once, by its last queries, while the streamed one
  gives what the transformers cache gives token by token (each token past the
  budget attends the kept set, in rounds), which keeps more of what a long answer
  needs at the cost of one block attention and one eviction per round of the prompt past the budget.
  ``"keep-prompt"`` keeps each request's whole prompt where vLLM wrote it and
  evicts only what it generates, at the budget: a request's window is its
  prompt plus the budget (the plugin's block manager frees the blocks between
  them, :mod:`.spec`; docs/vllm.md, "A window per request"); a ``prompt_keep``
  other than the whole prompt is refused (the held blocks are the prompt's own);
* one budget for every layer (``schedule="uniform"``): vLLM's window is one
  number;
* K/V stay in vLLM's blocks in the model's dtype: no ``kv_bits``,
  ``kv_residual`` (but 0, no token apart, which the paper preset sets),
  ``kv_demote``, ``kv_store`` or ``merge``;
* no ``prompt_chunk``: vLLM's scheduler chunks prompts itself;
* ``decode`` stays ``"dynamic"``: vLLM runs its own step over its blocks
  (the static step is the transformers adapter's).

A request may protect spans of its own prompt: ``SamplingParams(extra_args={"scissorhands_protect": [[s, e],
...]})``, or the bounds flat, ``[s0, e0, s1, e1, ...]`` (how the OpenAI server's ``vllm_xargs`` carries them: it
takes no nested lists), token positions ``[s, e)`` of the prompt that no layer evicts, as ``protect=`` does in the
transformers cache (:meth:`PluginSettings.request_protection` checks them; a bad list is
that request's one-line error, and the server stays up).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

from scissorhands.core.methods import EvictionMethod, get_method
from scissorhands.core.planning.assembly import CachePlan, plan
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.core.settings.declare import OWNED, from_strings
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import Protection, check_room

KEY = "scissorhands"
ENV = "SCISSORHANDS_VLLM"
#: A request's own protected spans: the key of its ``SamplingParams.extra_args``.
PROTECT = "scissorhands_protect"
#: What the adapter needs, whatever the library defaults are (see the module docstring).
FIXED: dict[str, object] = {"rounds": True}
#: The prefill modes the adapter runs, the first its default (see the module docstring).
PREFILLS = ("prompt-aware", "stream", "keep-prompt")
_UNSUPPORTED = {"kv_bits": None, "kv_residual": None, "kv_key_centers": None, "kv_store": None, "merge": False,
                "schedule": "uniform", "decode": "dynamic", "prompt_chunk": None,
                "head_budgets": None}
#: A value of an unsupported setting that asks for nothing the adapter lacks: no token of full-precision residual
#: (``preset="paper"`` sets it), which K/V in vLLM's blocks, never packed, are anyway.
_MOOT = {"kv_residual": 0}
#: Why a setting of :data:`_UNSUPPORTED` cannot run, where the common reason (K/V in vLLM's blocks, one budget for
#: every layer) is not it.
_WHY_NOT = {"head_budgets": "a vLLM layer's blocks hold every KV head, so one window serves all of them; head-level "
                            "budgets run in the transformers cache"}


class Refusal(ValueError):
    """A configuration the plugin cannot serve, refused at start-up in one line that starts with the vLLM setting's
    name (``LLM(...)`` raises it; the OpenAI server prints it and exits with code 2)."""


@dataclass(frozen=True)
class PluginSettings:
    """What the plugin runs with: the method, the plan of its budgeted layers (every layer the same: vLLM's
    blocks hold one budget), and the protected prefix."""

    method: type[EvictionMethod]
    plan: CachePlan
    protect_prefix: int = 0

    @property
    def config(self) -> ScissorhandsConfig:
        """The resolved cache configuration (the plan's)."""
        return self.plan.config

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def held_prefix(self) -> int:
        """The first tokens each request keeps where vLLM wrote them, beside its window: the protected prefix
        (with ``prefill="keep-prompt"`` the held prompt holds it instead). It is never rewritten, so its whole
        blocks can serve vLLM's prefix cache (a shared system prompt is computed and stored once)."""
        return 0 if self.config.prefill == "keep-prompt" else self.protect_prefix

    @property
    def window(self) -> int:
        """A request's window: the slots after what it holds. The budget, less a held prefix, which counts
        against the budget as a protected span does in the transformers cache."""
        return self.budget - self.held_prefix

    def protection(self) -> Protection | None:
        return Protection.prefix(self.protect_prefix) if self.protect_prefix else None

    def request_protection(self, extra_args, prompt: int) -> list[tuple[int, int]]:
        """The spans a request of ``prompt`` tokens protects (``extra_args[PROTECT]``), checked as the transformers
        cache checks ``protect=``: ``(start, end)`` token positions of the prompt, end exclusive, which with the
        protected prefix and the sinks leave each layer room to evict (:func:`check_room`). A one-line
        ``ValueError`` naming ``scissorhands_protect`` otherwise. Spans the request holds anyway (a held prompt,
        a held prefix) are left out of what is returned."""
        given = None if not isinstance(extra_args, dict) else extra_args.get(PROTECT)
        if given is None:
            return []
        if isinstance(given, (list, tuple)) and given and all(isinstance(v, int) for v in given):
            # flat bounds [s0, e0, s1, e1, ...]: what the OpenAI server's vllm_xargs can carry (no nested lists)
            if len(given) % 2:
                raise ValueError(f"{PROTECT}: flat bounds come in pairs [s0, e0, s1, e1, ...], got {len(given)} "
                                 "numbers")
            given = [list(given[i:i + 2]) for i in range(0, len(given), 2)]
        made = Protection.parse(given, PROTECT)
        if made is None:
            return []
        if len(made.rows) != 1 or (given and isinstance(given[0], (list, tuple)) and given[0]
                                   and isinstance(given[0][0], (list, tuple))):
            raise ValueError(f"{PROTECT}: one list of [start, end] spans for the request, got {given!r}")
        spans = sorted(made.rows[0])
        past = [s for s in spans if s[1] > prompt]
        if past:
            raise ValueError(f"{PROTECT}: spans protect the prompt's own tokens (it has {prompt}), got {past[0]!r}")
        if self.config.prefill == "keep-prompt":  # the whole prompt is held: nothing of it is ever evicted
            return []
        part = self.plan.layers[0]
        held = max(self.config.sinks, self.protect_prefix)
        check_room(Protection([([(0, held)] if held else []) + spans]), [(part.budget, part.recent, part.drop)],
                   PROTECT)
        return [(max(s, self.held_prefix), e) for s, e in spans if e > self.held_prefix]


def parse(given: dict) -> PluginSettings:
    """Settings from the ``scissorhands`` object; a one-line ``ValueError`` naming the bad key."""
    if not isinstance(given, dict):
        raise ValueError(f"{KEY}: the plugin settings must be a JSON object, got {type(given).__name__}")
    values = dict(given)
    name = values.pop("method", "scissorhands")
    if not isinstance(name, str):
        raise ValueError(f"method: must be a method name, got {name!r}")
    try:
        method = get_method(name)
    except ValueError as e:  # the registry names eval's 'methods'; the plugin's key is 'method'
        raise ValueError(f"method: {str(e).split(': ', 1)[-1]}") from None
    if method.is_full:
        raise ValueError("method: 'full' evicts nothing; leave the scissorhands settings out to run vLLM as it is")
    if "budget" not in values:
        raise ValueError("budget: is required (tokens each layer keeps per sequence and KV head)")
    budget = values.pop("budget")
    if isinstance(budget, str):
        budget = budget.strip()
        budget = int(budget) if budget.isdigit() else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 2:
        raise ValueError(f"budget: must be a token count >= 2, got {budget!r}")
    prefix = values.pop("protect_prefix", 0)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"protect_prefix: must be a token count >= 0, got {prefix!r}")
    fields = from_strings(CacheSettings, values, "scissorhands setting")
    fields.setdefault("prefill", PREFILLS[0])
    if fields["prefill"] not in PREFILLS:
        raise ValueError(f"prefill: the vLLM adapter runs {', '.join(repr(p) for p in PREFILLS)}, got "
                         f"{fields['prefill']!r}")
    if fields["prefill"] == "keep-prompt" and fields.get("prompt_keep") is not None:
        raise ValueError(f"prompt_keep: the vLLM adapter keeps a held prompt whole (its blocks stay where vLLM wrote "
                         f"it), got {fields['prompt_keep']!r}")
    for key, value in FIXED.items():
        if key in fields and fields[key] != value:
            raise ValueError(f"{key}: the vLLM adapter runs with {key}={value!r} (see scissorhands.vllm.settings), "
                             f"got {fields[key]!r}")
    for key, value in _UNSUPPORTED.items():
        if key in fields and fields[key] != value and fields[key] != _MOOT.get(key, value):
            why = _WHY_NOT.get(key, "K/V stay in vLLM's blocks, one budget for every layer")
            raise ValueError(f"{key}: not supported by the vLLM adapter ({why}), got {fields[key]!r}")
    for key in sorted(fields.keys() & OWNED.keys()):  # a setting of a plug-in the adapter cannot run at all
        owned = OWNED[key]  # (on the axes FIXED pins, the settings' own rule names the mode that is chosen)
        if owned.axis in _UNSUPPORTED and _UNSUPPORTED[owned.axis] not in owned.owners:
            whose = " or ".join(repr(o) for o in sorted(owned.owners))
            raise ValueError(f"{key}: not supported by the vLLM adapter (a setting of {owned.axis}={whose}; the "
                             f"adapter runs {owned.axis}={_UNSUPPORTED[owned.axis]!r})")
    settings = CacheSettings(**{**fields, **FIXED})
    protection = Protection.prefix(prefix) if prefix else None
    made = plan(settings, 1, method(), budget=budget, protection=protection, protect_name="protect_prefix")
    config = made.config
    for key, value in FIXED.items():
        if getattr(config, key) != value:
            raise ValueError(f"method: {name!r} needs {key}={getattr(config, key)!r}; the vLLM adapter runs with "
                             f"{key}={value!r}")
    state = method().make_state(config)
    if state is not None and not isinstance(state, ImportanceState):
        raise ValueError(f"method: {name!r} keeps per-token state of its own ({type(state).__name__}); the vLLM "
                         f"adapter holds the importance ring or nothing per slot")
    return PluginSettings(method, made, prefix)


def from_vllm(additional_config) -> PluginSettings | None:
    """This engine's settings, or None when the plugin is off (no ``scissorhands`` key, no ``SCISSORHANDS_VLLM``).

    vLLM's front end, its config step and each worker ask in turn; equal settings are parsed once per process."""
    given = None
    if isinstance(additional_config, dict) and KEY in additional_config:
        given = additional_config[KEY]
    elif os.environ.get(ENV, "").strip():
        try:
            given = json.loads(os.environ[ENV])
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV}: not a JSON object ({e.msg})") from None
    if given is None:
        return None
    try:
        text = json.dumps(given, sort_keys=True)
    except (TypeError, ValueError):  # not JSON (a Python object given to LLM(...)): parse names what is wrong
        return parse(given)
    return _parsed(text)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> PluginSettings:
    return parse(json.loads(text))


def with_budget(settings: PluginSettings, budget: int) -> PluginSettings:
    """The same settings at another budget (benchmarks)."""
    made = settings.plan
    return replace(settings, plan=plan(made.config, 1, made.method, budget=budget, protection=made.protection,
                                       protect_name="protect_prefix"))
