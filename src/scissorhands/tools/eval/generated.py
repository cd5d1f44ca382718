"""Tasks judged on what the model generates: each answer written greedily under each cache, and paired with
the full cache's answer to the same problem.

A task says how a problem is asked (:meth:`Generated.prompt_text`), how long a right answer is
(:meth:`Generated.answer_text`, what a budget's fraction refers to), where an answer ends (its stop strings) and
whether it is right (:meth:`Generated.judge`). The rest lives here once: greedy generation until a stop string,
the end-of-sequence token or ``max_new_tokens``; each problem answered once with the full cache (kept for the
grid's other cells, and in the full row's scores for a later run into the same folder, so adding a method later
costs that method's cell alone); and each cell's pairing with it: the difference in the share of right answers
with a paired interval, the discordant problems and McNemar's exact test, the share of answers equal to the full
cache's, and where each answer first parts from the full cache's (its first differing token).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from ..stats import mcnemar_p, paired_difference, proportion
from .base import Item, Task


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first of ``stops`` (all of it when none occurs)."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


class StopAtText:
    """A stopping criterion: the text generated since ``start`` holds one of ``stops``."""

    def __init__(self, tokenizer, start: int, stops: tuple[str, ...]):
        self.tokenizer, self.start, self.stops = tokenizer, start, stops

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.start:], skip_special_tokens=True)
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


#: The parts of a prompt's structure ``--protect-structure`` can protect, and those it protects when none are named.
STRUCTURE = ("asked", "turns", "forms", "code")
DEFAULT_STRUCTURE = ("asked", "turns")

#: A line of the asked problem's code that states its structure (after CodeComp's protected kinds, as far as a
#: prompt holds them): a name defined (``def``, ``class``, an import) or a test that calls it (``assert``, a
#: doctest's ``>>>``). The answer is written against these names and calls; the bodies of helper functions the
#: prompt shows (their assignments and returns) are left to the ranking, where they would crowd the budget.
CODE_LINE = re.compile(
    r"^[ \t]*(?:(?:async[ \t]+)?def\b|class\b|import\b|from[ \t]+[\w.]+[ \t]+import\b|assert\b|>>>)", re.M)


def code_lines(text: str, start: int = 0) -> list[tuple[int, int]]:
    """The character spans (end exclusive, each with its newline) of :data:`CODE_LINE`'s lines in ``text`` from
    character ``start`` on."""
    spans = []
    for found in CODE_LINE.finditer(text, start):
        end = text.find("\n", found.start())
        spans.append((found.start(), len(text) if end < 0 else end + 1))
    return spans


def structure_parts(given: bool | str | tuple[str, ...]) -> tuple[str, ...]:
    """The parts named by ``--protect-structure`` (True: the default ones), in :data:`STRUCTURE`'s order; a
    one-line ``ValueError`` naming the flag for an unknown or empty list."""
    if given is True:
        return DEFAULT_STRUCTURE
    names = [n.strip() for n in given.split(",")] if isinstance(given, str) else list(given or ())
    unknown = [n for n in names if n not in STRUCTURE]
    if unknown or not names:
        raise ValueError(f"protect-structure: parts from {', '.join(STRUCTURE)} (comma-separated), got {given!r}")
    return tuple(n for n in STRUCTURE if n in names)


def structure_spans(tokenizer, text: str, asked: int, parts: tuple[str, ...] = DEFAULT_STRUCTURE,
                    forms: tuple[tuple[int, int], ...] = ()) -> tuple[tuple[int, int], ...]:
    """The token spans (end exclusive) of ``text``'s structure, the ``parts`` of it named: ``asked``, from
    character ``asked`` to the end (the asked problem); ``turns``, each special token of the tokenizer that occurs
    in it (a chat template's turn markers), a turn's opening marker with its role line; ``forms``, the character
    spans ``forms`` (the worked examples' answer sentences); ``code``, the lines of the asked problem's code that
    define a name or test it (:data:`CODE_LINE`: the signature, imports, the assert or doctest calling the
    function), not the prose or the bodies around them. Mapped to tokens by the tokenizer's offsets, as
    ``text`` is encoded for the model (no special tokens added)."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    chars = [(asked, len(text))] if "asked" in parts else []
    if "forms" in parts:
        chars += list(forms)
    if "code" in parts:
        chars += code_lines(text, asked)
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ()) if "turns" in parts else set()
    if "turns" in parts:
        specials |= {a.content for a in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                     if a.special}
    for special in specials:
        if not special:
            continue
        at = text.find(special)
        while at >= 0:
            end = at + len(special)
            if "start" in special:  # a turn's opening marker (<|im_start|>): with its role line
                line = text.find("\n", end)
                end = len(text) if line < 0 else line + 1
            chars.append((at, end))
            at = text.find(special, end)
    hit = [any(e > lo and s < hi for lo, hi in chars) for s, e in enc["offset_mapping"]]
    spans: list[tuple[int, int]] = []
    for i, inside in enumerate(hit):
        if inside:
            if spans and spans[-1][1] == i:
                spans[-1] = (spans[-1][0], i + 1)
            else:
                spans.append((i, i + 1))
    return tuple(spans)


def held_tokens(cache) -> dict:
    """What a cache held when its answer was done: ``kv_seen``, the tokens it was given (prompt and answer), and
    ``kv_held``, the tokens it stored, per budgeted layer and KV head on average (transformers' own cache holds all
    it saw).
    Their ratio is the compression measured on the sequence itself, its prompt included, whatever the settings
    (a prompt kept beside the budget, protected spans, a budget above the length)."""
    layers = getattr(cache, "budgeted_layers", None)
    if not layers:
        seen = int(cache.get_seq_length())
        return {"kv_seen": seen, "kv_held": seen}
    stored = [float(layer.held_per_head().max()) for layer in layers]
    return {"kv_seen": int(layers[0].kv.slots.seen.max()), "kv_held": sum(stored) / len(stored)}


class Generated(Task):
    """The share of right greedy answers, each cell paired with the full cache over the same problems.

    A subclass sets ``max_new_tokens`` and ``_stops`` and says how to read, ask and judge its problems. Its
    public attributes key its cells (``runner.task_identity``), so the shared state here is private.
    """

    main_metric = "pass@1"
    verdict = "passed"  # an item score's name for its verdict; the full cache's is ``full_<verdict>``
    notes: tuple[str, ...] = ("error",)  # what judge() says of an answer besides its verdict, kept in its score
    max_new_tokens: int
    _stops: tuple[str, ...] = ()
    _tokenizer: Any = None  # the tokenizer items() was given; generation decodes with it
    #: The asked problem is code (what ``--protect-structure code`` protects lines of).
    holds_code: bool = False

    def problems(self) -> list[dict]:
        """Every problem, in order."""
        raise NotImplementedError

    def key_of(self, problem: dict) -> str:
        raise NotImplementedError

    def prompt_text(self, tokenizer, problem: dict) -> str:
        """What the model is given."""
        raise NotImplementedError

    def answer_text(self, problem: dict) -> str:
        """A right answer, known before anything is generated: with the prompt, what a budget's fraction refers to."""
        raise NotImplementedError

    def judge(self, problem: dict, answer: str) -> tuple[bool, dict]:
        """Whether ``answer`` (cut at the first stop string) is right, and the :attr:`notes` on it."""
        raise NotImplementedError

    def asked_from(self, text: str, problem: dict) -> int:
        """Where the asked problem itself starts in the prompt ``text`` (after any worked examples), in characters:
        what :meth:`protect_structure` protects, to the prompt's end."""
        return 0

    def answer_forms(self, text: str, asked: int) -> tuple[tuple[int, int], ...] | None:
        """The character spans of the worked examples' closing answer sentences in the prompt ``text`` (before
        the asked problem at ``asked``): the form an answer should end in. None: the task's prompts have none."""
        return None

    def protect_structure(self, parts: tuple[str, ...] = DEFAULT_STRUCTURE) -> None:
        """Protect each prompt's structure in every cell, the ``parts`` named (:func:`structure_spans`): by
        default the asked problem (:meth:`asked_from` to the prompt's end) and the chat template's turn markers
        with their role lines. Its cells are keyed apart (``structure`` is a public attribute, set only here: True
        for the default parts, else their names, so the keys of cells without it stay as they were)."""
        if "forms" in parts and type(self).answer_forms is Generated.answer_forms:
            raise ValueError(f"protect-structure: forms: {self.name}'s prompts have no worked answers to protect "
                             "(gsm8k's have)")
        if "code" in parts and not self.holds_code:
            raise ValueError(f"protect-structure: code: {self.name}'s prompts ask for no code (humaneval, "
                             "humaneval-chat and mbpp's do)")
        self.structure = True if parts == DEFAULT_STRUCTURE else ",".join(parts)

    def check(self) -> None:
        """Read the problems before the model loads: a missing package or a bad file is refused first."""
        self.problems()

    def items(self, tokenizer, limit):
        self._tokenizer = tokenizer

        def encode(text):
            return tokenizer(text, add_special_tokens=False).input_ids

        items = []
        for p in self.problems()[: limit or None]:
            text = self.prompt_text(tokenizer, p)
            prompt = encode(text)
            data = {"problem": p, "prompt": prompt}
            structure = getattr(self, "structure", False)
            if structure:
                parts = structure_parts(structure)
                asked = self.asked_from(text, p)
                data["spans"] = structure_spans(tokenizer, text, asked, parts, self.answer_forms(text, asked) or ())
            items.append(Item(self.key_of(p), len(prompt) + len(encode(self.answer_text(p))), data))
        return items

    def _complete(self, model, item, cache) -> tuple[list[int], str]:
        from transformers import StoppingCriteriaList

        prompt = item.data["prompt"]
        ids = torch.tensor([prompt], device=model.device)  # (1, T)
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
        stop = StoppingCriteriaList([StopAtText(self._tokenizer, len(prompt), self._stops)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False,
                                 max_new_tokens=self.max_new_tokens, pad_token_id=pad, stopping_criteria=stop)
        new = out[0, len(prompt):].tolist()
        return new, cut_at_stop(self._tokenizer.decode(new, skip_special_tokens=True), self._stops)

    def judged(self, item, tokens: list[int], completion: str, held: dict) -> dict:
        """An answer judged: its tokens, its text, the verdict with its notes, and what the cache held (``held``:
        ``kv_seen`` and ``kv_held``)."""
        right, notes = self.judge(item.data["problem"], completion)
        return {"tokens": tokens, "completion": completion, self.verdict: right, **notes, **held}

    def _judged(self, model, item, cache) -> dict:
        tokens, completion = self._complete(model, item, cache)
        return self.judged(item, tokens, completion, held_tokens(cache))

    def _full(self, model, item) -> dict:
        if "full" not in item.data:
            from transformers import DynamicCache

            item.data["full"] = self._judged(model, item, DynamicCache(config=model.config))
        return item.data["full"]

    def score(self, model, item, setup):
        from transformers import DynamicCache

        full = self._full(model, item)
        if "spans" in item.data:
            setup = replace(setup, protect=item.data["spans"])
        cache = setup.make_cache(model, len(item.data["prompt"]) + self.max_new_tokens)
        exact = isinstance(cache, DynamicCache)
        return self.paired(full if exact else self._judged(model, item, cache), full, exact)

    def paired(self, mine: dict, full: dict, exact: bool) -> dict:
        """An item's score: the answer ``mine`` (from :meth:`judged`) beside the full cache's ``full``; ``exact``:
        ``mine`` is the full cache's own answer (the full row, or a budget no answer reaches), whose tokens the
        score keeps so that a later run pairs with them."""
        a, b = mine["tokens"], full["tokens"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        score = {self.verdict: float(mine[self.verdict]), f"full_{self.verdict}": float(full[self.verdict]),
                 "first_divergence": first, "same_answer": float(mine["completion"] == full["completion"]),
                 **{k: mine[k] for k in self.notes}, "completion": mine["completion"], "new_tokens": len(a),
                 **{k: mine[k] for k in ("kv_seen", "kv_held") if k in mine}}
        if exact:  # the full row keeps its answers' tokens, so a later run pairs with them (take_full)
            score["tokens"] = a
        return score

    def take_full(self, items, scores):
        for item, s in zip(items, scores):
            if isinstance(s.get("tokens"), list) and "full" not in item.data:  # rows from before kept no tokens
                item.data["full"] = {"tokens": s["tokens"], "completion": s["completion"],
                                     self.verdict: bool(s[self.verdict]), **{k: s[k] for k in self.notes}}

    def aggregate(self, scores):
        right = [s[self.verdict] for s in scores]
        full = [s[f"full_{self.verdict}"] for s in scores]
        rate, stderr = proportion([bool(r) for r in right])
        diff, diff_half = paired_difference(right, full)
        lost = sum(1 for r, f in zip(right, full) if f and not r)
        gained = sum(1 for r, f in zip(right, full) if r and not f)
        firsts = sorted(s["first_divergence"] for s in scores)
        measured = {}
        if all("kv_held" in s for s in scores):  # rows written before it was measured have none
            seen, held = sum(s["kv_seen"] for s in scores), sum(s["kv_held"] for s in scores)
            measured = {"kv_seen_mean": seen / len(scores), "kv_held_mean": held / len(scores),
                        "measured_compression": seen / held}
        return {self.main_metric: rate, "acc": rate, "acc_stderr": stderr, **measured,
                f"full_{self.main_metric}": sum(full) / len(full), "diff_vs_full": diff,
                "diff_vs_full_ci95": diff_half, "lost": lost, "gained": gained, "mcnemar_p": mcnemar_p(lost, gained),
                "same_answer": sum(s["same_answer"] for s in scores) / len(scores), "first_divergence": firsts,
                "first_divergence_median": firsts[len(firsts) // 2], "n": len(scores)}
