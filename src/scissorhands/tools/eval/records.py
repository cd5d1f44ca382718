"""The results file of an eval grid: one JSON line per (task, method, budget), each keyed by everything that
determines it (model, task, method, budget, settings, data files, engine), read back, resumed, and a cell cut off
midway kept item by item (:class:`Partial`)."""

from __future__ import annotations

import hashlib
import json
import logging
import numbers
from pathlib import Path
from typing import Any

import torch

from scissorhands import __version__
from scissorhands.core.methods import EvictionMethod
from scissorhands.core.settings.config import CacheSettings
from scissorhands.hf.modelinfo import model_facts

from .base import Task

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
_RECORD_FIELDS = ("task", "method", "budget", "metric", "value")


def jsonable(value):
    """JSON form of settings values (NumPy scalars and paths included)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
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
    out: dict[str, Any] = {"name": name, "model_type": facts.model_type, "signature": facts.signature,
           "max_positions": facts.max_positions, "dtype": str(next(model.parameters()).dtype),
           "n_params": n_params, "weights": digest.hexdigest()[:16]}
    ends = generation_ends(model)
    if len(ends) > 1:  # a generation ends at any of several tokens (a single one: the key as it always was)
        out["ends"] = ends
    return out


def generation_ends(model) -> list[int]:
    """The tokens that end the model's generations (its generation config's ``eos_token_id``), as a list."""
    config = getattr(model, "generation_config", None)
    eos = None if config is None else config.eos_token_id
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def longer_full(records, key: dict) -> dict | None:
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
        out[key] = jsonable(value)
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
           "budget": jsonable(spec), "settings": jsonable(settings), "files": _settings_files(settings),
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
    missing = {k: BEFORE_IT_EXISTED.get(k, v) for k, v in jsonable(CacheSettings().as_dict()).items()
               if k not in settings}
    return {**key, "settings": {**settings, **missing}} if missing else key


def read_records(path: Path, name: str = "out") -> tuple[list[dict], int | None, int | None]:
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
        _, torn, line = read_records(path, name)
        if torn is not None:
            logger.warning("%s: %s line %d is incomplete (an interrupted write); it will be dropped", name, path, line)


def load_results(path: Path, name: str = "out") -> list[dict]:
    """The records of a results file; a torn last line is skipped with a warning."""
    if not path.is_file():
        return []
    records, torn, line = read_records(path, name)
    if torn is not None:
        logger.warning("%s: %s line %d is incomplete (an interrupted write); skipped", name, path, line)
    return records


def open_for_append(path: Path, name: str) -> list[dict]:
    """The file's records; a torn last line is cut off (reported) and a missing final newline added."""
    if not path.is_file():
        return []
    records, torn, line = read_records(path, name)
    if torn is not None:
        logger.warning("%s: %s line %d is incomplete (an interrupted write); dropped it", name, path, line)
        with path.open("r+b") as f:
            f.truncate(torn)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("ab") as f:
            f.write(b"\n")
    return records


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
            f.write(json.dumps(jsonable({"index": index, "item": item.key, "score": score, "wall_s": wall_s}))
                    + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        try:
            self.path.parent.rmdir()  # only when no other cell is waiting there
        except OSError:
            pass
