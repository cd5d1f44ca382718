"""The passkey task: prompts of exact length with the key where it was planted, scored through the cache."""

import pytest
import torch

from conftest import ByteTokenizer, tiny_model
from scissorhands import CacheSettings, get_method
from scissorhands.hf.scoring import ScoreSetup
from scissorhands.tools.eval import make_task
from scissorhands.tools.eval.passkey import INTRO, QUESTION, Passkey


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "filler.txt"
    path.write_text("Once more unto the breach, dear friends, once more. " * 200)
    return str(path)


def test_prompts_have_the_requested_length_and_the_key_at_its_depth(text_file):
    tok = ByteTokenizer()
    task = Passkey(lengths=(400, 600), depths=(0.1, 0.5, 0.9), data=text_file, seed=3)
    items = task.items(tok, None)
    assert len(items) == 6
    keys = set()
    for item in items:
        ctx, cont = item.data["ctx"], item.data["cont"]
        assert len(ctx) + len(cont) == item.length == item.data["length"]
        key = bytes(b - 3 for b in cont).decode().strip()
        assert len(key) == 5 and key.isdigit()
        keys.add(key)
        needle = tok(f"\nThe pass key is {key}.").input_ids
        where = next(i for i in range(len(ctx)) if ctx[i:i + len(needle)] == needle)
        filler = len(ctx) - len(tok(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n").input_ids) \
            - len(tok(QUESTION).input_ids) - len(tok(INTRO).input_ids)
        assert abs(where - len(tok(INTRO).input_ids) - int(item.data["depth"] * filler)) <= 1
        assert ctx[: len(tok(INTRO).input_ids)] == tok(INTRO).input_ids
        assert ctx[-len(tok(QUESTION).input_ids):] == tok(QUESTION).input_ids
    assert len(keys) == 6  # a fresh key per prompt
    assert [i.data["ctx"] for i in Passkey((400,), (0.5,), data=text_file, seed=3).items(tok, None)] == \
        [items[1].data["ctx"]]  # reproducible from the seed


@pytest.mark.parametrize("prefill", ["stream", "prompt-aware"])
def test_passkey_scores_through_the_cache_and_a_large_budget_equals_full(text_file, prefill):
    model = tiny_model("llama")
    task = make_task("passkey", data=text_file)
    task.lengths, task.depths = (400,), (0.2, 0.8)
    items = task.items(ByteTokenizer(), None)
    base = CacheSettings(recent=4, prefill=prefill)
    full = [task.score(model, it, ScoreSetup(get_method("full"), None, base)) for it in items]
    same = [task.score(model, it, ScoreSetup(get_method("scissorhands"), 800, base)) for it in items]
    small = [task.score(model, it, ScoreSetup(get_method("scissorhands"), 60, base)) for it in items]
    for f, s in zip(full, same):
        assert f["correct"] == s["correct"] and f["logprob"] == pytest.approx(s["logprob"], abs=1e-5)
    assert all(s["logprob"] != pytest.approx(f["logprob"], abs=1e-6) for f, s in zip(full, small))
    metrics = task.aggregate(small)
    assert set(metrics["by_length"]) == {"400"} and set(metrics["by_depth"]) == {"0.2", "0.8"}
    assert 0.0 <= metrics["acc"] <= 1.0 and metrics["n"] == 2
    assert torch.isfinite(torch.tensor([s["logprob"] for s in small])).all()


def test_multikey_prompts_plant_every_key_and_ask_each_in_turn(text_file):
    from scissorhands.tools.eval.passkey import FACT, MultiKey

    tok = ByteTokenizer()
    task = MultiKey(lengths=(500,), keys=3, data=text_file, seed=2)
    items = task.items(tok, None)
    assert len(items) == 3 and sorted(i.data["depth"] for i in items) == pytest.approx([0.1, 0.5, 0.9])
    for item in items:
        ctx, cont = item.data["ctx"], item.data["cont"]
        assert len(ctx) + len(cont) == 500
        spans = item.data["facts"]
        assert len(spans) == 3 and all(a < b <= c for (a, b), (c, _) in zip(spans, spans[1:]))
        planted = [bytes(b - 3 for b in ctx[a:b]).decode() for a, b in spans]
        key = bytes(b - 3 for b in cont).decode().strip()
        # The asked fact is planted, under the asked name, with the answer's key.
        assert FACT.format(name=item.data["asked"], key=key) in planted
        assert len({p.split(" is ")[-1] for p in planted}) == 3  # three different keys
    assert make_task("multikey").name == "multikey"
    with pytest.raises(ValueError, match="^keys: "):
        MultiKey(keys=1)


@pytest.mark.parametrize("task_name", ["passkey", "multikey"])
def test_protected_facts_survive_any_budget(text_file, task_name):
    """With ``protect_facts`` the planted spans are never evicted, so the scores at a tiny budget see them:
    the facts' positions are in every layer's stored set (checked through the cache the scorer builds)."""
    from dataclasses import replace

    model = tiny_model("llama")
    task = make_task(task_name, data=text_file)
    task.lengths = (700,)
    item = task.items(ByteTokenizer(), 1)[0]
    facts = item.data["facts"]
    setup = ScoreSetup(get_method("scissorhands"), 60 + sum(b - a for a, b in facts),
                       CacheSettings(recent=4))
    protected = replace(setup, protect=tuple(facts))
    cache = protected.make_cache(model, item.length)
    with torch.no_grad():
        model(torch.tensor([item.data["ctx"]]), cache=cache)
    for layer in cache.budgeted_layers:
        for head in layer.stored_positions(0).tolist():
            assert {p for a, b in facts for p in range(a, b)} <= set(head)
    task.protect_facts = True
    with_facts = task.score(model, item, setup)
    assert with_facts == task.score(model, item, protected)  # the task passes its facts as the spans
    task.protect_facts = False
    assert task.score(model, item, setup)["logprob"] != pytest.approx(with_facts["logprob"], abs=1e-7)


def test_the_filler_is_tokenized_once_per_tokenizer_and_text_and_equals_the_corpus_tokens(tmp_path):
    """The filler (seconds to tokenize for Shakespeare) is kept for the next cell: the same ids as
    ``corpus_tokens``, the same object for the same tokenizer and texts, tokenized again for other texts."""
    from conftest import byte_tokenizer_fast
    from scissorhands.tools.eval import passkey
    from scissorhands.tools.text import corpus_tokens

    tok = byte_tokenizer_fast()
    texts = [("a.txt", "To be, or not to be: that is the question. " * 20), ("b.txt", "Whether 'tis nobler.")]
    first = passkey._filler(tok, texts)
    assert list(first) == corpus_tokens(tok, texts)
    assert passkey._filler(byte_tokenizer_fast(), list(texts)) is first  # an equal tokenizer, equal texts
    other = passkey._filler(tok, texts[:1])
    assert other is not first and list(other) == corpus_tokens(tok, texts[:1])
