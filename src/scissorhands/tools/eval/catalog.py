"""Tasks by name: the one place ``--tasks`` names are turned into tasks."""

from __future__ import annotations

from pathlib import Path

from .base import Task
from .generated import Generated, structure_parts
from .gsm8k import GSM8K
from .humaneval import HumanEval
from .mbpp import MBPP
from .passkey import MultiKey, Passkey
from .tasks import MC_TASKS, Agreement, Lambada, MultipleChoice, Perplexity

GENERATED = ("humaneval", "humaneval-chat", "mbpp", "gsm8k")
TASKS = ("ppl", "lambada", "agreement", "passkey", "multikey") + GENERATED + MC_TASKS


def make_task(name: str, seq_len: int = 2048, n_windows: int = 16, data: str | None = None,
              structure: bool | str = False) -> Task:
    """The task ``name``; ``structure``: protect each prompt's structure (:meth:`Generated.protect_structure`),
    for the tasks that generate: True for the asked problem and the turn markers, or the parts by name
    (``"asked,forms"``, :data:`.generated.STRUCTURE`)."""
    task = _make_task(name, seq_len, n_windows, data)
    if structure is not None and structure is not False:  # (an empty list of parts is refused by name)
        if not isinstance(task, Generated):
            raise ValueError(f"protect-structure: {task.name} does not generate; it applies to "
                             f"{', '.join(GENERATED)}")
        task.protect_structure(structure_parts(structure))
    return task


def _make_task(name: str, seq_len: int, n_windows: int, data: str | None) -> Task:
    if name == "ppl":
        return Perplexity(seq_len, n_windows, data)
    if name == "lambada":
        return Lambada()
    if name == "agreement":
        return Agreement(data=data)
    if name == "passkey":
        return Passkey(data=data)
    if name == "multikey":
        return MultiKey(data=data)
    if name in ("humaneval", "humaneval-chat"):
        return HumanEval(data=data, chat=name == "humaneval-chat")
    if name == "mbpp":
        return MBPP(data=data)
    if name == "gsm8k":
        return GSM8K(data=data)
    if name in MC_TASKS:
        return MultipleChoice(name)
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        p = Path(name)
        if not p.is_file():
            raise ValueError(f"tasks: no such task file {name!r}")
        return MultipleChoice(p.name.split(".")[0], path=str(p))
    raise ValueError(f"tasks: unknown task {name!r}; choose from {', '.join(TASKS)} or a .jsonl file")
