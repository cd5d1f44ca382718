"""Run a grid of (task, method, budget), write one JSON line per result, summarise and plot."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from scissorhands import __version__
from scissorhands.core.methods import EvictionMethod, get_method
from scissorhands.core.planning.memory_target import store_bytes
from scissorhands.core.settings.budget import resolve_budget
from scissorhands.core.settings.config import CacheSettings
from scissorhands.core.settings.schedule import layer_budgets
from scissorhands.core.settings.tiers import tier_caps
from scissorhands.core.stores import STORES, store_name
from scissorhands.hf.cache import memory_shape
from scissorhands.hf.modelinfo import model_facts
from scissorhands.hf.scoring import ScoreSetup

from ..paths import exclusive
from ..stats import NO_INTERVAL, Z95, paired_difference, plus_minus
from .base import Task

logger = logging.getLogger(__name__)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V per token of a full cache, summed over the budgeted (full-attention) layers."""
    return model_facts(model).kv_bytes_per_token(next(model.parameters()).element_size())


def kv_bytes(model, settings, budget: float, evicts: bool = True) -> float:
    """Bytes of one sequence's K/V at an average ``budget``: the store's own byte model (``KVStore.bytes_for``,
    what ``memory=`` plans with and a test holds against what each store allocates), plus the residual.

    Dense and packed stores cost the same per token, so a fractional mean budget is exact; a demoting store's
    pools are shares of a layer's budget, so it is sized at the nearest whole budget.
    """
    shape = memory_shape(model)
    if settings.kv_demote is not None:
        return store_bytes(settings.with_budget(max(1, round(budget))), shape, evicts)
    per_head = STORES[store_name(settings)].bytes_for(settings, shape, 1)
    if per_head is None:  # a store that declares no byte model: counted at the model's dtype
        per_head = (shape.head_dim_k + shape.head_dim_v) * shape.itemsize
    return budget * shape.layers * shape.kv_heads * per_head + kv_residual_bytes(model, settings, budget, evicts)


def kv_residual_bytes(model, settings, budget: float, evicts: bool = True) -> float:
    """Bytes of a sequence's full-precision residual at an average ``budget`` (model dtype), 0 without one.

    Each budgeted layer's own budget comes from the schedule, and its residual from that budget.
    """
    if not settings.quantized:
        return 0
    facts = model_facts(model)
    per_layer_token = facts.kv_bytes_per_token(next(model.parameters()).element_size()) / len(facts.full_layers)
    config = settings.with_budget(max(1, round(budget)))
    return sum(min(settings.residual_for(b, evicts), b) * per_layer_token
               for b in layer_budgets(config, len(facts.full_layers)))


RESULTS_FILE = "results.jsonl"
_RECORD_FIELDS = ("task", "method", "budget", "metric", "value")


def _jsonable(value):
    """JSON form of settings values (NumPy scalars and paths included)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)


def _file_identity(path) -> dict | None:
    """Absolute path, size and modification time of a data file or folder (its ``*.txt`` files), or None."""
    if not isinstance(path, (str, Path)) or str(path) in ("", "shakespeare"):
        return None
    p = Path(path).expanduser()
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file())
    else:
        return None
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "sha256": _digest(p, files)}


def _digest(root: Path, files: list[Path]) -> str:
    """SHA-256 of the files' names (relative to ``root``) and contents: a result is keyed by what it read."""
    h = hashlib.sha256()
    for f in files:
        h.update((str(f.relative_to(root)) if f != root else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _settings_files(settings: dict) -> dict:
    """Content digests of the files a cache's settings name (a JSON schedule, key centres, a head ranking)."""
    out = {}
    for key in ("schedule", "kv_key_centers", "head_budgets"):
        value = settings.get(key)
        if isinstance(value, str) and value.endswith(".json") and Path(value).expanduser().is_file():
            path = Path(value).expanduser()
            out[f"{key}_sha256"] = _digest(path, [path])
    return out


def model_identity(model, model_name: str) -> dict:
    """What identifies a model's results: its name, architecture, dtype and a digest of sampled weights.

    The digest reads an evenly strided sample of at most 4,096 values of every
    parameter, so it is cheap and still differs between checkpoints of one
    architecture.
    """
    digest = hashlib.sha256()
    n_params = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            n_params += flat.numel()
            sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu()
            digest.update(name.encode())
            digest.update(sample.numpy().tobytes())
    facts = model_facts(model)
    name = str(model_name)
    local = Path(name).expanduser()
    if local.exists():
        name = str(local.resolve())
    return {"name": name, "model_type": facts.model_type, "signature": facts.signature,
            "max_positions": facts.max_positions, "dtype": str(next(model.parameters()).dtype),
            "n_params": n_params, "weights": digest.hexdigest()[:16]}


def _longer_full(records, key: dict) -> dict | None:
    """A full row whose key is ``key`` but for a larger ``limit`` (or none): its items begin with ``key``'s."""
    want = {k: v for k, v in key.items() if k != "limit"}
    for r in records:
        theirs = r.get("key")
        if not isinstance(theirs, dict) or {k: v for k, v in theirs.items() if k != "limit"} != want:
            continue
        if theirs.get("limit") is None or theirs["limit"] >= key["limit"]:
            return r
    return None


def task_identity(task: Task) -> dict:
    """A task's settings: its public attributes of plain types, and the identity of its data files."""
    out: dict = {"class": type(task).__name__, "name": task.name}
    for key, value in sorted(vars(task).items()):
        if key.startswith("_") or not isinstance(value, (str, int, float, bool, tuple, list, type(None))):
            continue
        out[key] = _jsonable(value)
        ident = _file_identity(value) if key in ("data", "path") else None
        if ident is not None:
            out[f"{key}_file"] = ident
    return out


def run_key(model_id: dict, task_id: dict, method: type[EvictionMethod], spec, base: CacheSettings,
            limit: int | None, seed: int, engine: dict | None = None) -> dict:
    """Everything that determines one grid cell's result; two cells with equal keys give equal results.

    A full cache that is not packed is transformers' own cache (:meth:`ScoreSetup.make_cache`), which no
    cache setting changes, so its key holds none: one full row serves every setting of a sweep. A cell run by
    another engine than transformers (``engine``: its name and version, :mod:`.engine`) is keyed by it too.
    """
    resolved = method.resolve(base)
    exact = method.is_full and not resolved.quantized
    settings = {} if exact else resolved.as_dict()
    if exact:  # protected structure changes no answer of transformers' own cache: one full row serves both
        task_id = {k: v for k, v in task_id.items() if k != "structure"}
    key = {"version": __version__, "model": model_id, "task": task_id, "method": method.name,
           "budget": _jsonable(spec), "settings": _jsonable(settings), "files": _settings_files(settings),
           "limit": limit, "seed": seed}
    if engine is not None:
        key["engine"] = engine
    return key


def key_id(key: dict) -> str:
    """A short stable digest of a :func:`run_key`."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


#: Settings added with a default that changed what a cell computes, and the value that computes as before:
#: a record written without ``mean_cap`` divided by every query (the plain mean, ``None``).
BEFORE_IT_EXISTED = {"mean_cap": None}


def as_keyed_today(key: dict) -> dict:
    """An older record's key as a run today would write it.

    - Settings added since it was written take their defaults. A setting is added with a default that
      keeps the behaviour from before it existed, so a cell scored before the setting existed is the cell
      scored at its default (the rows of a grid from before ``decode`` and ``kv_demote`` existed, scored
      again, are equal to every bit). A setting whose default changed what a cell computes takes the value
      that behaves as before it existed (:data:`BEFORE_IT_EXISTED`).
    - An exact full cache's settings are dropped, as :func:`run_key` now keys it by none.

    Any other difference (version, model, task, a setting's value) still makes a new cell.
    """
    settings = key.get("settings")
    if not isinstance(settings, dict) or not settings:
        return key
    if key.get("method") == "full" and not CacheSettings(kv_bits=settings.get("kv_bits")).quantized:
        return {**key, "settings": {}, "files": {}}
    missing = {k: BEFORE_IT_EXISTED.get(k, v) for k, v in _jsonable(CacheSettings().as_dict()).items()
               if k not in settings}
    return {**key, "settings": {**settings, **missing}} if missing else key


def _read_records(path: Path, name: str = "out") -> tuple[list[dict], int | None, int | None]:
    """Records of a results file, the byte offset of a torn last line (or None) and its line number.

    Raises
    ------
    ValueError
        ``"<name>: ..."`` for a file that is not ours: not UTF-8, a line before
        the last that is not JSON, or a JSON line that is not a result record.
    """
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: {str(path)!r} is not a scissorhands results file (not UTF-8 text); "
                         "move it away or choose another folder") from None
    lines = text.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict] = []
    offset = 0
    for i, line in enumerate(lines):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if i == last:  # an interrupted write: the run can go on without it
                    return records, len(text[:offset].encode()), i + 1
                raise ValueError(f"{name}: {str(path)!r} line {i + 1} is not JSON; the file is damaged or not a "
                                 "scissorhands results file; move it away or choose another folder") from None
            if not isinstance(rec, dict) or any(f not in rec for f in _RECORD_FIELDS):
                raise ValueError(f"{name}: {str(path)!r} line {i + 1} is not a scissorhands result record; "
                                 "move the file away or choose another folder")
            records.append(rec)
        offset += len(line)
    return records, None, None


def check_results_file(path: Path, name: str = "out") -> None:
    """Refuse a results file that is not ours before any work starts; warn about a torn last line."""
    if path.is_file():
        _, torn, line = _read_records(path, name)
        if torn is not None:
            logger.warning("%s: %s line %d is incomplete (an interrupted write); it will be dropped", name, path, line)


def load_results(path: Path, name: str = "out") -> list[dict]:
    """The records of a results file; a torn last line is skipped with a warning."""
    if not path.is_file():
        return []
    records, torn, line = _read_records(path, name)
    if torn is not None:
        logger.warning("%s: %s line %d is incomplete (an interrupted write); skipped", name, path, line)
    return records


def _open_for_append(path: Path, name: str) -> list[dict]:
    """The file's records; a torn last line is cut off (reported) and a missing final newline added."""
    if not path.is_file():
        return []
    records, torn, line = _read_records(path, name)
    if torn is not None:
        logger.warning("%s: %s line %d is incomplete (an interrupted write); dropped it", name, path, line)
        with path.open("r+b") as f:
            f.truncate(torn)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("ab") as f:
            f.write(b"\n")
    return records


@dataclass(frozen=True)
class MemorySpec:
    """A grid row's memory budget (``eval --memory``): the store and token budget are chosen per item.

    Its JSON form, in records, keys and tables, is ``"memory=<value>"``.
    """

    value: float | int

    def __str__(self) -> str:
        return f"memory={self.value}"


def _choose(model, spec: MemorySpec, length: int, method: type[EvictionMethod], base: CacheSettings):
    from scissorhands.hf.cache import choose_memory

    return choose_memory(model, base, method(), spec.value, length)


def _check_distinct_budgets(task: Task, items, method: type[EvictionMethod], budgets: list, base: CacheSettings):
    """Refuse two budgets that resolve to the same tokens on every item (identical grid rows).

    Every budget a cell will use is also configured once, so settings that do
    not fit it (e.g. a drop count above the budget) fail before any cell runs.
    """
    protected = base.protected
    seen: dict[tuple, float | int] = {}
    for spec in budgets:
        if isinstance(spec, MemorySpec):
            continue  # chosen per item; an unreachable one is refused before any cell runs (run_grid)
        if isinstance(spec, int) and spec <= protected:
            raise ValueError(f"budgets: a token count must be > recent + sinks ({protected}), got {spec}")
        used = tuple(min(resolve_budget(spec, i.length, protected, "budgets"), i.length) for i in items)
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


FULL = get_method("full")

PARTIAL_DIR = "partial"
"""Folder of ``out_dir`` where a cell's finished items wait, one JSON line each, until its record is written."""


class Partial:
    """The items of one cell scored so far, in ``out_dir/partial/<key_id>.jsonl``, so that an interrupted cell
    resumes at its first unscored item (a HumanEval cell can take an hour).

    The file is named by the cell's key, so it serves only the same settings; each line names its item, and the
    lines are read up to the first that is torn or names another item (the rest is scored again). ``resume``
    False starts the cell afresh.
    """

    def __init__(self, path: Path, items: list, resume: bool):
        self.path = path
        self.scores: list[dict] = []
        self.wall_s = 0.0
        if not resume or not path.is_file():
            self.path.unlink(missing_ok=True)
            return
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for index, line in enumerate(lines[: len(items)]):
            try:
                entry = json.loads(line)
                if entry["index"] != index or entry["item"] != items[index].key or not isinstance(entry["score"], dict):
                    break
                wall_s = float(entry["wall_s"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):  # torn, or not a line of ours
                break
            self.scores.append(entry["score"])
            self.wall_s = wall_s
        if len(self.scores) < len(lines):  # rewrite without what is not taken, so new lines follow good ones
            path.write_text("".join(line + "\n" for line in lines[: len(self.scores)]), encoding="utf-8")
        if self.scores:
            logger.info("%s: resuming after %d scored items", path, len(self.scores))

    def add(self, index: int, item, score: dict, wall_s: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable({"index": index, "item": item.key, "score": score, "wall_s": wall_s}))
                    + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        try:
            self.path.parent.rmdir()  # only when no other cell is waiting there
        except OSError:
            pass


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
        _read_records(path, "out")  # a foreign file is refused before anything is computed or written
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
                for wanted in budgets:  # a memory budget no store meets is refused before any cell runs
                    if isinstance(wanted, MemorySpec):
                        for length in sorted({i.length for i in items}):
                            _choose(model, wanted, length, method, base)
        all_items.append(items)
    out_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(out_dir, "out"):  # two runs into one folder at once would both write every row
        existing = _open_for_append(path, "out")
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
                exact = _longer_full(done.values(), full_key)
            if exact is not None and isinstance(exact.get("item_scores"), list):
                task.take_full(items, exact["item_scores"])
            for method in methods:
                protected = base.protected  # the floor of resolve_budget, as the recorded results always used
                for spec in ([None] if method.is_full else budgets):
                    key = run_key(model_id, task_id, method, spec, base, limit, seed, engine_id)
                    kid = key_id(key)
                    if kid in done:
                        results.append(done[kid])
                        continue
                    scores, budgets_used = [], []
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
                        cell_base = base
                        if isinstance(spec, MemorySpec):
                            choice = _choose(model, spec, item.length, method, base)
                            choices.append(choice)
                            budget, cell_base = choice.config.budget, choice.config.settings
                        else:
                            budget = None if spec is None else resolve_budget(spec, item.length, protected)
                        budgets_used.append(item.length if budget is None else min(budget, item.length))
                        if index < len(partial.scores):
                            scores.append(partial.scores[index])
                            if method.is_full and not method.resolve(base).quantized:
                                task.take_full([item], [partial.scores[index]])
                            continue
                        if engine is not None:
                            scores.append(batch[index - len(partial.scores)])
                        else:
                            scores.append(task.score(model, item, ScoreSetup(method, budget, cell_base, seed)))
                        partial.add(index, item, scores[-1], earlier + time.perf_counter() - start)
                    metrics = task.aggregate(scores)
                    mean_len = sum(i.length for i in items) / len(items)
                    mean_budget = sum(budgets_used) / len(budgets_used)
                    rec = {
                        "task": task.name, "method": method.name, "budget": _jsonable(spec), "model": model_name,
                        "metric": task.main_metric, "value": metrics[task.main_metric], "metrics": metrics,
                        "compression": mean_len / mean_budget, "mean_length": mean_len, "mean_budget": mean_budget,
                        "kv_bytes": (sum(c.peak_bytes for c in choices) / len(choices)) if choices else
                        kv_bytes(model, method.resolve(base), mean_budget, evicts=not method.is_full),
                        "full_kv_bytes": mean_len * per_token,
                        "wall_s": earlier + time.perf_counter() - start, "n_items": len(items), "seed": seed,
                        "config": _jsonable(method.resolve(base).as_dict()),
                        "key_id": kid, "key": key,
                        "item_scores": scores,
                    }
                    if choices:  # what memory= chose, per item (the store is the same whenever the lengths are)
                        rec["memory_choice"] = [c.record() for c in choices]
                        rec["compression"] = rec["full_kv_bytes"] / rec["kv_bytes"]  # in bytes, everything stored
                        rec["config"] = _jsonable(choices[0].config.settings.as_dict())
                    with path.open("a") as f:
                        f.write(json.dumps(_jsonable(rec)) + "\n")
                    partial.remove()
                    logger.info("%s: %s=%.4f (%.1f s)", desc, task.main_metric, rec["value"], rec["wall_s"])
                    results.append(rec)
        return results


def _fmt(rec: dict) -> str:
    m = rec["metrics"]
    if rec["task"] == "ppl":
        return f"{m['ppl']:.2f}{plus_minus((m['ppl_ci95'][1] - m['ppl_ci95'][0]) / 2, 2)}"
    if rec["task"] == "agreement":
        return f"{m['first_divergence']:.1f}{plus_minus(m['first_divergence_ci95'], 1)}"
    if "acc_norm" in m:
        return f"{m['acc']:.3f} / {m['acc_norm']:.3f}{plus_minus(m['acc_stderr'], 3)}"
    return f"{m['acc']:.3f}{plus_minus(m['acc_stderr'], 3)}"


def _row_settings(rec: dict) -> dict:
    """The settings a row was scored with, as a run today keys them (an exact full cache: none)."""
    key = rec.get("key")
    if isinstance(key, dict) and isinstance(key.get("settings"), dict):
        return as_keyed_today(key)["settings"]
    config = rec.get("config")
    return {**_jsonable(CacheSettings().as_dict()), **config} if isinstance(config, dict) else {}


def _setting_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def row_labels(results: list[dict]) -> list[str]:
    """A name for each row: its method, and where one method's rows were scored with different settings
    (two runs into one folder, ``--prefill stream`` then ``prompt-aware``), the settings that tell them apart,
    so that no row hides another in a table or a plot."""
    settings = [_row_settings(r) for r in results]
    defaults = _jsonable(CacheSettings().as_dict())
    differ: dict[str, list[str]] = {}
    for method in dict.fromkeys(r["method"] for r in results):
        mine = [s for r, s in zip(results, settings) if r["method"] == method]
        keyed = [s for s in mine if s]
        names = list(dict.fromkeys(k for s in keyed for k in s))
        seen = [{json.dumps(s.get(k), sort_keys=True) for s in keyed} for k in names]
        if len(keyed) < len(mine):  # beside an exact full cache (keyed by no settings): what sets the others apart
            seen = [v | {json.dumps(defaults.get(k), sort_keys=True)} for k, v in zip(names, seen)]
        differ[method] = [k for k, v in zip(names, seen) if len(v) > 1]
    labels = []
    for r, s in zip(results, settings):
        parts = [f"{k}={_setting_text(s.get(k))}" for k in differ[r["method"]]] if s else []
        labels.append(f"{r['method']} ({', '.join(parts)})" if parts else r["method"])
    return labels


def _in_order(results: list[dict]) -> list[dict]:
    """Rows for a table: the full cache first, then each method in the order it first appears, from the least
    compression to the most (rows appended by later runs land beside their method, not at the end)."""
    first = {m: i for i, m in enumerate(dict.fromkeys(r["method"] for r in results))}
    return sorted(results, key=lambda r: (r["method"] != "full", first[r["method"]], r.get("compression") or 0.0))


def summary_table(results: list[dict]) -> str:
    """Markdown: one row per method (and settings, see :func:`row_labels`) and budget, one column per task."""
    results = _in_order(results)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    labels = row_labels(results)
    rows = list(dict.fromkeys((name, r["budget"]) for name, r in zip(labels, results)))
    by = {(name, r["budget"], r["task"]): r for name, r in zip(labels, results)}
    head = "| method | budget | " + " | ".join(tasks) + " |"
    lines = [head, "|" + "---|" * (len(tasks) + 2)]
    for name, budget in rows:
        cells = []
        for t in tasks:
            r = by.get((name, budget, t))
            cells.append("" if r is None else f"{_fmt(r)} ({r['compression']:.1f}x)")
        lines.append(f"| {name} | {'full' if budget is None else budget} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def folder_results(path: Path, results: list[dict]) -> list[dict]:
    """The rows of ``results`` and every row of earlier runs in the results file at ``path`` that was measured
    the same way (version, model, task windows, limit, seed): what the folder's summary.md and plots show.

    Each cell appears once (the last row written for it); rows measured another way are left out, as are rows
    without a key (written before keys existed).
    """
    def ident(rec: dict):
        key = rec.get("key")
        if not isinstance(key, dict):
            return None
        return json.dumps({k: v for k, v in key.items() if k not in ("method", "budget", "settings", "files")},
                          sort_keys=True)

    wanted = {ident(r) for r in results} - {None}
    cells: dict[str, dict] = {}
    for rec in load_results(path):
        if ident(rec) in wanted:
            cells[key_id(as_keyed_today(rec["key"]))] = rec
    for rec in results:
        key = rec.get("key")
        cells[key_id(as_keyed_today(key)) if isinstance(key, dict) else str(id(rec))] = rec
    return list(cells.values())


def paired_vs_full(results: list[dict], task: str = "ppl") -> list[dict]:
    """Each evicting row's difference to the full cache, paired over the same items, with a 95% interval.

    For ``ppl`` the mean NLL per window (``delta_nll``); for tasks whose items
    are right or wrong (multiple choice, LAMBADA, passkey) the accuracy
    (``delta_acc``, in points of a share, e.g. -0.05 = five points lower).
    """
    fulls = [r for r in results if r["task"] == task and r["method"] == "full"]
    if not fulls:
        return []
    full = next((r for r in fulls if not _row_settings(r)), fulls[0])  # the exact full cache, where there is one
    key = "nll" if task == "ppl" else "correct"
    if not full["item_scores"] or key not in full["item_scores"][0]:
        return []
    base = [float(s[key]) for s in full["item_scores"]]
    out = []
    for r, label in zip(results, row_labels(results)):
        if r["task"] != task or r is full or len(r["item_scores"]) != len(base):
            continue
        mean, half = paired_difference([float(s[key]) for s in r["item_scores"]], base)
        name = "delta_nll" if task == "ppl" else "delta_acc"
        out.append({"task": task, "method": r["method"], "label": label, "budget": r["budget"],
                    "compression": r["compression"], name: mean, f"{name}_ci95": half})
    return out


def summary_markdown(results: list[dict]) -> str:
    """summary.md: first the paired differences to the full cache (the numbers that matter), then every result."""
    lines = []
    results = _in_order(results)
    tasks = list(dict.fromkeys(r["task"] for r in results))
    paired = {t: {(p["label"], p["budget"]): p for p in paired_vs_full(results, t)} for t in tasks}
    shown = [t for t in tasks if paired[t]]
    if shown:
        lines += ["## Against the full cache", "",
                  "Paired over the same items, mean difference and 95% interval: ΔNLL in nats per token (lower is "
                  "better; perplexity ratio = exp ΔNLL), Δacc in points of accuracy (higher is better).", "",
                  "| method | budget | " + " | ".join(f"{t} {'ΔNLL' if t == 'ppl' else 'Δacc'}" for t in shown) + " |",
                  "|" + "---|" * (len(shown) + 2)]
        for label, budget in dict.fromkeys(k for t in shown for k in paired[t]):
            cells = []
            for t in shown:
                p = paired[t].get((label, budget))
                name = "delta_nll" if t == "ppl" else "delta_acc"
                if p is None:
                    cells.append("")
                elif t == "ppl":
                    cells.append(f"{p[name]:+.4f}{plus_minus(p[name + '_ci95'], 4)} ({p['compression']:.1f}x)")
                else:
                    pts = plus_minus(100 * p[name + "_ci95"], 1)
                    cells.append(f"{100 * p[name]:+.1f}{pts} pts ({p['compression']:.1f}x)")
            lines.append(f"| {label} | {budget} | " + " | ".join(cells) + " |")
        lines += ["", "## Every result", ""]
    lines.append(summary_table(results))
    if any(NO_INTERVAL in line for line in lines):
        lines += ["", f"{NO_INTERVAL}: one item, so no interval."]
    return "\n".join(lines)


def _interval(rec: dict) -> tuple[float, float] | None:
    """The 95% interval of a row's main metric, when its task reports one."""
    m, v = rec["metrics"], rec["value"]
    if rec["task"] == "ppl" and isinstance(m.get("ppl_ci95"), list):
        lo, hi = m["ppl_ci95"]
        return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None
    for name in (f"{rec['metric']}_ci95",):
        if isinstance(m.get(name), (int, float)) and math.isfinite(m[name]):
            return v - m[name], v + m[name]
    se = m.get(f"{rec['metric']}_stderr")
    if isinstance(se, (int, float)) and math.isfinite(se):
        return v - Z95 * se, v + Z95 * se
    return None


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per task: the main metric against compression, one line per method (and settings), with 95% intervals."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task in dict.fromkeys(r["task"] for r in results):
        recs = [r for r in results if r["task"] == task]
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = row_labels(recs)
        for method in dict.fromkeys(labels):
            mine = sorted((r for r, name in zip(recs, labels) if name == method), key=lambda r: r["compression"])
            spans = [_interval(r) for r in mine]
            if method == "full":
                line = ax.axhline(mine[0]["value"], color="black", linestyle="--", label="full (95% band)")
                if spans[0] is not None:
                    ax.axhspan(*spans[0], color=line.get_color(), alpha=0.08)
                continue
            xs, ys = [r["compression"] for r in mine], [r["value"] for r in mine]
            low = [y - (s[0] if s else y) for y, s in zip(ys, spans)]
            high = [(s[1] if s else y) - y for y, s in zip(ys, spans)]
            err = [low, high]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method)
        ax.set_xlabel("KV compression (sequence length / budget)")
        ax.set_ylabel(recs[0]["metric"])
        ax.set_xscale("log")
        ticks = sorted({round(r["compression"], 1) for r in recs})
        ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(f"{task} — {recs[0]['model']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{task}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
