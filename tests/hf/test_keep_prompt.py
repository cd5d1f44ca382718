"""The kept-prompt prefill (``prefill="keep-prompt"``): the prompt (or ``prompt_keep`` of it) beside the budget.

Each rule is held to another path of the library that the suite already holds to the naive reference:

* a prompt kept whole equals a streamed cache whose budget is the prompt plus the budget, with the prompt
  protected (the same recent window and drop amount): the same tokens, the same kept positions;
* a prompt kept in part keeps, after the prompt, exactly what the prompt-aware prefill keeps at a budget of that
  many tokens (the same judgement by the prompt's last queries);
* invariants after every step: no row stores more than its kept prompt plus the budget, no kept prompt token is
  ever evicted, the recent window is kept; a padded batch keeps what each sequence keeps alone; a budget that
  covers the generation gives the full cache's tokens.
"""

import pytest
import torch
from transformers import DynamicCache

from conftest import batch_and_alone, left_padded, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig


def greedy(model, ids, cache, new_tokens=24, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, cache=cache,
                              max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


class Watch:
    """Checks every layer's invariants after each decode step (an eviction listener sees every event; the
    stored lengths are read after each forward)."""

    def __init__(self, cache, prompt_lengths):
        self.cache, self.prompt = cache, prompt_lengths
        self.steps = 0

    def check(self):
        for layer in self.cache.budgeted_layers:
            kv = layer.kv
            assert kv.held is not None
            assert bool((kv.slots.lengths <= kv.budget + kv.held).all())
            for row, p in enumerate(self.prompt):
                stored = layer.stored_positions(row)  # (H_kv, L)
                prompt_kept = (stored < p).sum(dim=1)
                assert bool((prompt_kept == kv.held[row]).all()), "a kept prompt token was evicted"
                seen = int(kv.slots.seen[row])
                newest = set(range(max(p, seen - kv.recent), seen))
                for head in stored:
                    assert newest <= set(head.tolist()), "the recent window was evicted"
        self.steps += 1


@pytest.mark.parametrize("rounds", [False, True], ids=["per-step", "rounds"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_a_prompt_kept_whole_is_a_streamed_cache_with_the_prompt_protected(arch, rounds):
    """Also in rounds (the vLLM plugin's eviction): the victims of each round are chosen among the generated
    tokens alone, as a cache of the prompt plus the budget with the prompt protected chooses them."""
    model = tiny_model(arch)
    p, budget, recent, drop = 37, 12, 3, 2 + 2 * rounds
    ids = left_padded([p], seed=5)[0]
    kept = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, recent=recent, drop=drop, prefill="keep-prompt",
                                                       rounds=rounds))
    same = ScissorhandsCache(model, ScissorhandsConfig(budget=p + budget, recent=recent, drop=drop, rounds=rounds),
                             protect=[(0, p)])
    a, b = greedy(model, ids, kept, 30), greedy(model, ids, same, 30)
    assert torch.equal(a, b)
    assert sum(layer.compressions for layer in kept.budgeted_layers) > 0  # the generation was evicted
    for la, lb in zip(kept.budgeted_layers, same.budgeted_layers):
        assert torch.equal(la.stored_positions(0), lb.stored_positions(0))
        assert int(la.kv.held[0]) == p


@pytest.mark.parametrize("keep", [0.5, 9])
def test_a_prompt_kept_in_part_keeps_what_the_prompt_aware_prefill_keeps_at_that_budget(keep):
    model = tiny_model("llama")
    p = 40
    ids = left_padded([p], seed=6)[0]
    n = 20 if keep == 0.5 else 9
    kept = ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=2, prefill="keep-prompt", prompt_keep=keep,
                                                       observe=8))
    aware = ScissorhandsCache(model, ScissorhandsConfig(budget=n, recent=2, prefill="prompt-aware", observe=8))
    with torch.no_grad():
        model(ids, attention_mask=torch.ones_like(ids), cache=kept)
        model(ids, attention_mask=torch.ones_like(ids), cache=aware)
    for la, lb in zip(kept.budgeted_layers, aware.budgeted_layers):
        assert la.stored_positions(0).shape[-1] == n
        assert torch.equal(la.stored_positions(0), lb.stored_positions(0))
        assert int(la.kv.held[0]) == n


@pytest.mark.parametrize("keep", [None, 0.4, 7])
def test_no_row_exceeds_its_prompt_plus_the_budget_and_the_kept_prompt_stays(keep):
    model = tiny_model("qwen2")
    lengths = [30, 19, 26]
    ids, mask = left_padded(lengths, seed=7)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, recent=3, drop=2, prefill="keep-prompt",
                                                        prompt_keep=keep))
    watch = Watch(cache, lengths)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache)
        watch.check()
        for _ in range(25):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = model(nxt, attention_mask=mask, cache=cache)
            watch.check()
    assert watch.steps == 26
    assert sum(layer.compressions for layer in cache.budgeted_layers) > 0


@pytest.mark.parametrize("keep,rounds", [(None, False), (0.5, False), (6, False), (None, True), (0.5, True)])
def test_a_padded_batch_keeps_what_each_sequence_keeps_alone(keep, rounds):
    model = tiny_model("llama")
    config = ScissorhandsConfig(budget=9, recent=2, drop=2, prefill="keep-prompt", prompt_keep=keep, rounds=rounds)
    batch, alone = batch_and_alone(model, config, [21, 14, 17], new_tokens=20)
    for row, cache in enumerate(alone):
        for lb, la in zip(batch.budgeted_layers, cache.budgeted_layers):
            assert int(lb.kv.held[row]) == int(la.kv.held[0])


def test_a_budget_that_covers_the_generation_gives_the_full_caches_tokens():
    model = tiny_model("mistral")
    ids = left_padded([33], seed=8)[0]
    full = greedy(model, ids, DynamicCache(config=model.config), 20)
    kept = greedy(model, ids, ScissorhandsCache(model, ScissorhandsConfig(budget=20, prefill="keep-prompt")), 20)
    assert torch.equal(full, kept)


def test_beams_carry_each_rows_kept_prompt():
    model = tiny_model("llama")
    ids, mask = left_padded([18, 11], seed=9)
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=8, recent=2, drop=2, prefill="keep-prompt"))
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=12, num_beams=2, do_sample=False,
                       pad_token_id=0)
    for layer in cache.budgeted_layers:
        assert layer.kv.held.tolist() == [18, 18, 11, 11]
        assert bool((layer.kv.slots.lengths <= 8 + layer.kv.held).all())


@pytest.mark.parametrize("given,message", [
    (dict(prompt_keep=0.5), "prompt_keep: a setting of prefill='keep-prompt'"),
    (dict(prefill="keep-prompt", prompt_keep=1.5), "prompt_keep: a fraction must be in (0, 1)"),
    (dict(prefill="keep-prompt", prompt_keep=0), "prompt_keep: must be"),
    (dict(prefill="keep-prompt", prompt_chunk=64), "prompt_chunk: a setting of prefill='prompt-aware', got "
                                                   "prefill='keep-prompt'"),
    (dict(prefill="keep-prompt", decode="static"), "prefill: 'keep-prompt'"),
])
def test_settings_it_cannot_serve_are_one_line(given, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CacheSettings(**given)


def test_a_memory_target_is_refused_in_one_line():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="memory: a keep-prompt prefill"):
        ScissorhandsCache.for_memory(model, 0.3, 64, CacheSettings(prefill="keep-prompt"))


def test_protected_spans_in_the_prompt_are_kept_with_it_and_those_after_it_count_against_the_budget():
    model = tiny_model("llama")
    ids = left_padded([40], seed=10)[0]
    spans = [(3, 20)]  # 17 tokens, more than the 8 the prompt keeps and more than the budget
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=10, recent=2, drop=2, prefill="keep-prompt",
                                                        prompt_keep=8), protect=spans)
    greedy(model, ids, cache, 20)
    for layer in cache.budgeted_layers:
        assert int(layer.kv.held[0]) == 17 + 2  # the spans and the recent window the prompt ends in
        for head in layer.stored_positions(0):
            assert set(range(3, 20)) | {38, 39} <= set(head.tolist())
    late = ScissorhandsCache(model, ScissorhandsConfig(budget=10, recent=2, drop=2, prefill="keep-prompt"),
                             protect=[(0, 4), (41, 49)])  # 8 protected tokens after the prompt: 6 fit
    with pytest.raises(ValueError, match="protect: 8 protected tokens after the prompt"):
        greedy(model, ids, late, 4)
