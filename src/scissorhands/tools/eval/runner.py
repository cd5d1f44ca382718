"""Run a grid of (task, method, budget): each cell scored item by item (or by an engine in one batch) and written
as one JSON line (:mod:`.records`) as it finishes; :mod:`.report` summarises and plots."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from scissorhands.core.methods import EvictionMethod, get_method
from scissorhands.core.planning.assembly import budget_tokens
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.tiers import tier_caps
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup

from ..paths import exclusive
from .base import Task
from .records import (
    PARTIAL_DIR,
    RESULTS_FILE,
    Partial,
    as_keyed_today,
    jsonable,
    key_id,
    longer_full,
    model_identity,
    open_for_append,
    read_records,
    run_key,
    task_identity,
)

logger = logging.getLogger(__name__)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V per token of a full cache, summed over the budgeted (full-attention) layers."""
    return model_facts(model).kv_bytes_per_token(next(model.parameters()).element_size())


@dataclass(frozen=True)
class MemorySpec:
    """A grid row's memory budget (``eval --memory``): the store and token budget are chosen per item.

    Its JSON form, in records, keys and tables, is ``"memory=<value>"``.
    """

    value: float | int

    def __str__(self) -> str:
        return f"memory={self.value}"


def _plan(model, spec, length: int, method: type[EvictionMethod], base: CacheSettings, seed: int = 0):
    """The plan of a cell's cache for one item of ``length`` tokens: a budget as given (a token count or a
    fraction of the item) or a memory target, made tokens by the plan alone."""
    from scissorhands.hf.cache import cache_plan

    memory = spec.value if isinstance(spec, MemorySpec) else None
    return cache_plan(model, base, method(seed=seed), budget=None if memory is not None else spec, memory=memory,
                      length=length)


def _check_distinct_budgets(task: Task, items, method: type[EvictionMethod], budgets: list, base: CacheSettings):
    """Refuse two budgets that resolve to the same tokens on every item (identical grid rows).

    Every budget a cell will use is also configured once, so settings that do
    not fit it (e.g. a drop count above the budget) fail before any cell runs.
    """
    protected = method.resolve(base).protected
    seen: dict[tuple, float | int] = {}
    for spec in budgets:
        if isinstance(spec, MemorySpec):
            continue  # chosen per item; an unreachable one is refused before any cell runs (run_grid)
        # The plan's rule makes each item's tokens (and refuses a count at or below the protected tokens).
        used = tuple(min(budget_tokens(spec, i.length, base, method, "budgets"), i.length) for i in items)
        # A demoting cache is built even when the budget covers the item (its widths' shares still apply).
        building = {b for b, i in zip(used, items) if b < i.length or base.kv_demote is not None}
        for budget in sorted(building):
            # A setting that does not fit this budget fails now, not mid-grid (the residual against each
            # layer's recent window too).
            config = method.configure(base, budget)
            for layer_budget in config.schedule if isinstance(config.schedule, tuple) else (budget,):
                config.check_residual(layer_budget, evicts=not method.is_full)
                if config.kv_demote is not None:
                    tier_caps(config.kv_demote, layer_budget, config.recent_for(layer_budget),
                              config.drop_for(layer_budget))
        if used in seen:
            raise ValueError(
                f"budgets: {seen[used]} and {spec} give the same budget on every {task.name} item "
                f"(the floor is recent + sinks + 1 = {protected + 1} tokens, the ceiling the item length); "
                "drop one of them"
            )
        seen[used] = spec


def _check_structure(model, task: Task, items, method: type[EvictionMethod], budgets: list, base: CacheSettings,
                     seed: int = 0) -> None:
    """Each problem's protected structure (``--protect-structure``) in the plan its cell will build, at every
    budget, before any cell runs: one line naming the first problem whose spans leave a layer no room to evict
    (it would otherwise stop the grid at that problem)."""
    for item in items:
        spans = item.data.get("spans") if isinstance(item.data, dict) else None
        if not spans:
            continue
        total = len(item.data["prompt"]) + getattr(task, "max_new_tokens", 0)  # the cache its cell builds
        for spec in budgets:
            setup = replace(ScoreSetup.planned(_plan(model, spec, item.length, method, base, seed), method, seed),
                            protect=tuple(tuple(s) for s in spans))
            try:
                setup.cache_plan(model, total)
            except ValueError as e:
                raise ValueError(f"protect-structure: problem {item.key} at budget {spec}: "
                                 f"{str(e).split(': ', 1)[-1]}") from None


FULL = get_method("full")


def run_grid(model, tokenizer, *, model_name: str, tasks: list[Task], methods: list[type[EvictionMethod]],
             budgets: list, base: CacheSettings, out_dir: Path, limit: int | None = None, seed: int = 0,
             resume: bool = True, engine=None) -> list[dict]:
    """Evaluate every method at every budget on every task.

    Each record carries a ``key`` with everything that determines its result
    (model name, architecture, dtype and weights digest; the task and its
    settings and data files; method, budget, every cache setting, limit, seed)
    and its digest ``key_id``. With ``resume``, a cell whose key is already in
    ``out_dir/results.jsonl`` is reused, so an interrupted grid continues where
    it stopped, and a cell cut off midway resumes at its first unscored item
    (:class:`Partial`); records of other settings stay in the file untouched and are
    never reused: the new results are appended beside them. A record from
    before a cache setting existed matches at that setting's default
    (:func:`as_keyed_today`), and one full row serves every setting. A torn last line
    (an interrupted write) is reported and cut off; a file that is not a
    results file is refused.

    Returns
    -------
    list of dict
        The records of this grid only, in grid order.

    ``engine`` (:class:`.engine.VLLMEngine`, or None for transformers) generates each cell's answers in one batch
    (the generated tasks only; :func:`.engine.check_engine_grid` says what it runs), keyed by the engine.

    Raises
    ------
    ValueError
        One line naming the parameter: two budgets that resolve to the same
        tokens on every item, a task with no items or items longer than the
        model's positions, a foreign results file.
    """
    path = out_dir / RESULTS_FILE
    if path.is_file():
        read_records(path, "out")  # a foreign file is refused before anything is computed or written
    per_token = kv_bytes_per_token(model)
    model_id = model_identity(model, model_name)
    limit_positions = model_id["max_positions"]
    all_items = []
    for task in tasks:  # every check before the first cell is computed
        items = task.items(tokenizer, limit)
        if not items:
            raise ValueError(f"tasks: {task.name} has no items")
        longest = max(i.length for i in items)
        if isinstance(limit_positions, int) and limit_positions > 0 and longest > limit_positions:
            what = "seq-len" if task.name == "ppl" else "tasks"
            raise ValueError(f"{what}: {task.name} has items of {longest} tokens, more than the model's "
                             f"{limit_positions} positions")
        for method in methods:
            if not method.is_full:
                _check_distinct_budgets(task, items, method, budgets, base)
                if engine is None:
                    _check_structure(model, task, items, method, budgets, base, seed)
                else:  # each problem's spans as the plugin will check them
                    from .engine import check_grid_spans

                    check_grid_spans(task, items, method, budgets, base)
                for wanted in budgets:  # a memory budget no store meets is refused before any cell runs
                    if isinstance(wanted, MemorySpec):
                        for length in sorted({i.length for i in items}):
                            _plan(model, wanted, length, method, base)
        all_items.append(items)
    out_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(out_dir, "out"):  # two runs into one folder at once would both write every row
        existing = open_for_append(path, "out")
        done: dict[str, dict] = {}
        if resume:
            for r in existing:
                if isinstance(r.get("key"), dict):
                    done.setdefault(key_id(as_keyed_today(r["key"])), r)
                if "key_id" in r:
                    done[r["key_id"]] = r
        results = []
        engine_id = None if engine is None else engine.identity()
        for task, items in zip(tasks, all_items):
            task_id = task_identity(task)
            full_key = run_key(model_id, task_id, FULL, None, CacheSettings(), limit, seed, engine_id)
            exact = done.get(key_id(full_key))
            if exact is None and limit is not None:  # a full row over more items serves their first ``limit``
                exact = longer_full(done.values(), full_key)
            if exact is not None and isinstance(exact.get("item_scores"), list):
                task.take_full(items, exact["item_scores"])
            for method in methods:
                for spec in ([None] if method.is_full else budgets):
                    key = run_key(model_id, task_id, method, spec, base, limit, seed, engine_id)
                    kid = key_id(key)
                    if kid in done:
                        results.append(done[kid])
                        continue
                    scores, budgets_used, held_bytes = [], [], []
                    desc = f"{task.name} {method.name} {'full' if spec is None else spec}"
                    choices = []
                    partial = Partial(out_dir / PARTIAL_DIR / f"{kid}.jsonl", items, resume)
                    earlier = partial.wall_s  # the cell's time before an interruption
                    start = time.perf_counter()
                    batch: list[dict] = []  # the engine's scores of the items not scored before an interruption
                    if engine is not None:
                        from .engine import engine_scores

                        batch = engine_scores(engine, task, items[len(partial.scores):], method,
                                              None if spec is None else int(spec), base)
                    for index, item in enumerate(tqdm(items, desc=desc, leave=False)):
                        setup = ScoreSetup(method, None, base, seed)
                        if spec is not None and engine is not None:  # the engine plans its own layers
                            setup = ScoreSetup(method, budget_tokens(spec, item.length, base, method), base, seed)
                        elif spec is not None:  # one plan per item: its budget in tokens, or a memory target's choice
                            setup = ScoreSetup.planned(_plan(model, spec, item.length, method, base, seed), method,
                                                       seed)
                            if setup.plan is not None and setup.plan.memory_choice is not None:
                                choices.append(setup.plan.memory_choice)
                        budget = setup.budget
                        budgets_used.append(item.length if budget is None else min(budget, item.length))
                        # K/V held at the item's end: the plan's byte model (the engine keeps dense K/V).
                        held_bytes.append(budgets_used[-1] * per_token if engine is not None else
                                          setup.kv_bytes(model, item.length))
                        if index < len(partial.scores):
                            scores.append(partial.scores[index])
                            if method.is_full and not method.resolve(base).quantized:
                                task.take_full([item], [partial.scores[index]])
                            continue
                        if engine is not None:
                            scores.append(batch[index - len(partial.scores)])
                        else:
                            scores.append(task.score(model, item, setup))
                        partial.add(index, item, scores[-1], earlier + time.perf_counter() - start)
                    metrics = task.aggregate(scores)
                    mean_len = sum(i.length for i in items) / len(items)
                    mean_budget = sum(budgets_used) / len(budgets_used)
                    rec = {
                        "task": task.name, "method": method.name, "budget": jsonable(spec), "model": model_name,
                        "metric": task.main_metric, "value": metrics[task.main_metric], "metrics": metrics,
                        "compression": mean_len / mean_budget, "mean_length": mean_len, "mean_budget": mean_budget,
                        "kv_bytes": (sum(c.peak_bytes for c in choices) / len(choices)) if choices else
                        sum(held_bytes) / len(held_bytes),
                        "full_kv_bytes": mean_len * per_token,
                        "wall_s": earlier + time.perf_counter() - start, "n_items": len(items), "seed": seed,
                        "config": jsonable(method.resolve(base).as_dict()),
                        "key_id": kid, "key": key,
                        "item_scores": scores,
                    }
                    if choices:  # what memory= chose, per item (the store is the same whenever the lengths are)
                        rec["memory_choice"] = [c.record() for c in choices]
                        rec["compression"] = rec["full_kv_bytes"] / rec["kv_bytes"]  # in bytes, everything stored
                        rec["config"] = jsonable(choices[0].config.settings.as_dict())
                    with path.open("a") as f:
                        f.write(json.dumps(jsonable(rec)) + "\n")
                    partial.remove()
                    logger.info("%s: %s=%.4f (%.1f s)", desc, task.main_metric, rec["value"], rec["wall_s"])
                    results.append(rec)
        return results
