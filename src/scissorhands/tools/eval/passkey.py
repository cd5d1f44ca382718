"""Passkey retrieval: can the cache still give back a fact planted deep in a long prompt?

A random 5-digit key is planted in real filler text (Shakespeare by default) at
a given depth; the prompt opens with one line saying that something is hidden
(which raised the full cache's recall on SmolLM2 from 3 to 4 of 5 prompts at
1k tokens) and ends with the question. The item is correct when
the model's greedy prediction of every token of the key, scored through the
compressed cache, is exact. Prompts are built at token level so each has
exactly the requested length, and every (length, depth, trial) cell gets its
own filler and key, drawn from the seed and the cell alone.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import replace

from scissorhands.hf.scoring import continuation_logprobs

from ..stats import proportion
from ..text import corpus_tokens, load_texts
from .base import Item, Task

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER = " {key}"
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
LENGTHS = (1024, 2048, 4096)


_FILLER: dict[tuple[str, str], array] = {}  # the last filler tokenized: its tokenizer's and texts' digests -> ids


def _filler(tokenizer, texts: list[tuple[str, str]]) -> array:
    """The filler's token ids, the texts joined end to end (:func:`.text.corpus_tokens`). Shakespeare is about
    five million tokens, seconds to tokenize, so the last filler is kept (as 32-bit ids) for the next cell, keyed by
    the tokenizer's full definition and the texts' content; a tokenizer that cannot say its definition is not
    kept."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None and hasattr(backend, "to_str") else None
    if definition is None:
        return array("i", corpus_tokens(tokenizer, texts))
    digest = hashlib.sha256()
    for name, text in texts:
        digest.update(name.encode() + b"\0" + text.encode("utf-8", "surrogatepass") + b"\0")
    key = (hashlib.sha256(definition.encode()).hexdigest(), digest.hexdigest())
    if key not in _FILLER:
        _FILLER.clear()
        _FILLER[key] = array("i", corpus_tokens(tokenizer, texts))
    return _FILLER[key]


class Passkey(Task):
    """Greedy exact recall of a planted 5-digit key, by prompt length and depth.

    Parameters
    ----------
    lengths : tuple of int
        Total tokens per prompt (filler + key sentence + question + answer).
    depths : tuple of float
        Where the key sentence starts, as a fraction of the filler.
    trials : int
        Prompts per (length, depth) cell, each with its own key and filler.
    data : str, optional
        Filler text file or folder (default: Shakespeare).
    seed : int
    protect_facts : bool
        Score with the key sentence as a protected span (never evicted): the ceiling a user who knows
        where the fact is can reach.
    """

    name = "passkey"
    main_metric = "acc"

    def __init__(self, lengths=LENGTHS, depths=DEPTHS, trials: int = 1, data: str | None = None, seed: int = 0,
                 protect_facts: bool = False):
        self.lengths, self.depths, self.trials, self.data, self.seed = lengths, depths, trials, data, seed
        self.protect_facts = protect_facts

    def items(self, tokenizer, limit):
        filler = _filler(tokenizer, load_texts(self.data))
        items = []

        def encode(text):
            return tokenizer(text, add_special_tokens=False).input_ids

        intro = encode(INTRO)
        for length in self.lengths:
            for depth in self.depths:
                for trial in range(self.trials):
                    rng = random.Random(f"{self.seed}/{length}/{depth}/{trial}")  # a cell does not depend on others
                    key = str(rng.randint(10000, 99999))
                    needle, question, answer = encode(NEEDLE.format(key=key)), encode(QUESTION), \
                        encode(ANSWER.format(key=key))
                    room = length - len(intro) - len(needle) - len(question) - len(answer)
                    if room < 1 or room > len(filler):
                        raise ValueError(f"tasks: passkey length {length} does not fit the filler text")
                    start = rng.randrange(0, len(filler) - room + 1)
                    text = filler[start: start + room].tolist()
                    at = int(depth * room)
                    context = intro + text[:at] + needle + text[at:] + question
                    fact = (len(intro) + at, len(intro) + at + len(needle))
                    items.append(Item(f"L{length}-d{depth:g}-t{trial}", length,
                                      {"ctx": context, "cont": answer, "length": length, "depth": depth,
                                       "facts": [fact]}))
        return items[: limit or None]

    def score(self, model, item, setup):
        if self.protect_facts:
            setup = replace(setup, protect=tuple(tuple(f) for f in item.data["facts"]))
        ((logprob, greedy),) = continuation_logprobs(model, item.data["ctx"], [item.data["cont"]], setup)
        return {"correct": greedy, "logprob": logprob, "length": item.data["length"], "depth": item.data["depth"]}

    def aggregate(self, scores):
        acc, se = proportion([s["correct"] for s in scores])
        by_length = {}
        for length in sorted({s["length"] for s in scores}):
            hits = [s["correct"] for s in scores if s["length"] == length]
            by_length[str(length)] = sum(hits) / len(hits)
        by_depth = {}
        for depth in sorted({s["depth"] for s in scores}):
            hits = [s["correct"] for s in scores if s["depth"] == depth]
            by_depth[f"{depth:g}"] = sum(hits) / len(hits)
        return {"acc": acc, "acc_stderr": se, "by_length": by_length, "by_depth": by_depth, "n": len(scores)}


NAMES = ("red door", "blue lamp", "green boat", "old clock", "silver key", "quiet garden", "tall tower", "small bell")
FACT = "\nThe pass key of the {name} is {key}.\n"
ASK = "\nWhat is the pass key of the {name}? The pass key of the {name} is"


class MultiKey(Passkey):
    """Several keys, each under its own name, planted at spread depths; the question asks for one of them.

    A harder retrieval than :class:`Passkey`: the cache must keep every fact until the question names the
    one it wants, and must not mix them up. Each prompt plants ``keys`` facts at depths spread evenly
    (from 10% to 90% of the filler, in a shuffled order of names); the prompts of a length ask each fact in
    turn, so every depth is asked. Correct when every token of the asked key is predicted greedily.

    Parameters
    ----------
    lengths : tuple of int
        Total tokens per prompt.
    keys : int
        Facts per prompt (at most ``len(NAMES)``).
    trials : int
        Prompts per (length, asked fact).
    data, seed, protect_facts
        As for :class:`Passkey` (``protect_facts`` protects every planted fact).
    """

    name = "multikey"

    def __init__(self, lengths=LENGTHS, keys: int = 4, trials: int = 1, data: str | None = None, seed: int = 0,
                 protect_facts: bool = False):
        if not 2 <= keys <= len(NAMES):
            raise ValueError(f"keys: must be 2 to {len(NAMES)}, got {keys}")
        depths = tuple(0.1 + 0.8 * i / (keys - 1) for i in range(keys))
        super().__init__(lengths, depths, trials, data, seed, protect_facts)
        self.keys = keys

    def items(self, tokenizer, limit):
        filler = _filler(tokenizer, load_texts(self.data))

        def encode(text):
            return tokenizer(text, add_special_tokens=False).input_ids

        intro = encode(INTRO)
        items = []
        for length in self.lengths:
            for asked in range(self.keys):
                for trial in range(self.trials):
                    rng = random.Random(f"multikey/{self.seed}/{length}/{asked}/{trial}")
                    names = rng.sample(NAMES, self.keys)  # names[i] is planted at depth i
                    keys = [str(rng.randint(10000, 99999)) for _ in names]
                    facts = [encode(FACT.format(name=n, key=k)) for n, k in zip(names, keys)]
                    question = encode(ASK.format(name=names[asked]))
                    answer = encode(ANSWER.format(key=keys[asked]))
                    room = length - len(intro) - sum(map(len, facts)) - len(question) - len(answer)
                    if room < 1 or room > len(filler):
                        raise ValueError(f"tasks: multikey length {length} does not fit the filler text")
                    start = rng.randrange(0, len(filler) - room + 1)
                    text = filler[start: start + room].tolist()
                    context, spans, cut = list(intro), [], 0
                    for depth, fact in zip(self.depths, facts):
                        at = int(depth * room)
                        context += text[cut:at]
                        spans.append((len(context), len(context) + len(fact)))
                        context += fact
                        cut = at
                    context += text[cut:] + question
                    depth = self.depths[asked]
                    items.append(Item(f"L{length}-k{asked}-t{trial}", length,
                                      {"ctx": context, "cont": answer, "length": length, "depth": depth,
                                       "facts": spans, "asked": names[asked]}))
        return items[: limit or None]
