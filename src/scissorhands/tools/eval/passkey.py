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

import random

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
    """

    name = "passkey"
    main_metric = "acc"

    def __init__(self, lengths=LENGTHS, depths=DEPTHS, trials: int = 1, data: str | None = None, seed: int = 0):
        self.lengths, self.depths, self.trials, self.data, self.seed = lengths, depths, trials, data, seed

    def items(self, tokenizer, limit):
        filler = corpus_tokens(tokenizer, load_texts(self.data))
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
                    text = filler[start: start + room]
                    at = int(depth * room)
                    context = intro + text[:at] + needle + text[at:] + question
                    items.append(Item(f"L{length}-d{depth:g}-t{trial}", length,
                                      {"ctx": context, "cont": answer, "length": length, "depth": depth}))
        return items[: limit or None]

    def score(self, model, item, setup):
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
