"""Head-level budgets (``head_budgets``): a layer's KV heads split into groups, each a budgeted layer of its own.

* groups of equal budgets keep exactly what one layer over every head keeps (the same tokens, the same kept
  positions), and a budget covering the sequence is the full cache;
* invariants after every step: no head stores more than its own budget, each keeps its recent window, streaming
  heads keep the sinks; the memory is real (fewer bytes held than the uniform cache at the same budget);
* a padded batch keeps what each sequence keeps alone; the measured tokens held are the mean per KV head;
* the calibration's score equals a naive loop over the model's own attention probabilities;
* bad input is one line naming the parameter.
"""

import json

import pytest
import torch
from transformers import DynamicCache

from conftest import batch_and_alone, left_padded, save_tiny_model, tiny_model
from scissorhands import CacheSettings, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.layer.audit import EvictionAudit
from scissorhands.core.layer.budgeted import BudgetedKV
from scissorhands.core.layer.heads import HeadGroups
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.planning.heads import HeadRanking, head_budgets, retrieval_heads
from scissorhands.hf.cache import cache_plan
from scissorhands.tools.cli import main
from scissorhands.tools.eval.generated import held_tokens


def ranking(path, scores, model_type="qwen2", layers=(0, 1), query_heads=6):
    """A head ranking file for the tiny models (2 layers of 2 KV heads)."""
    HeadRanking("tiny", model_type, tuple(layers), len(scores[0]), query_heads, tuple(map(tuple, scores)), 4, 4,
                "test", 64).save(path)
    return str(path)


def greedy(model, ids, cache, new_tokens=20, mask=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, cache=cache,
                              max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)


def split_by_head(model, cache, config):
    """Replace every budgeted layer of ``cache`` with its KV heads in groups of one, each at the layer's own
    budget, recent window and drop: the split with nothing changed but the split."""
    made = cache_plan(model, config)
    for i, layer in enumerate(cache.budgeted_layers):
        part, heads = made.layers[i], model.config.num_key_value_heads
        layer.kv = HeadGroups([((h,), BudgetedKV(part.budget, part.recent, part.drop, Scissorhands(), made.state(),
                                                 layer.layer_idx, made.store(i), prefill=made.prefill(i)))
                               for h in range(heads)])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_groups_of_equal_budgets_keep_what_one_layer_keeps(arch):
    model = tiny_model(arch)
    ids = left_padded([45], seed=2)[0]
    config = ScissorhandsConfig(budget=16, recent=3, drop=2)
    one, split = ScissorhandsCache(model, config), ScissorhandsCache(model, config)
    split_by_head(model, split, config)
    a, b = greedy(model, ids, one, 25), greedy(model, ids, split, 25)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    for la, lb in zip(one.budgeted_layers, split.budgeted_layers):
        assert torch.equal(la.stored_positions(0), lb.stored_positions(0))
        assert la.kv.compressions > 0
    assert held_tokens(one) == held_tokens(split)


def test_a_share_of_one_is_the_uniform_cache(tmp_path):
    model = tiny_model("qwen2")
    ids = left_padded([40], seed=6)[0]
    path = ranking(tmp_path / "h.json", [[0.2, 0.1], [0.3, 0.4]])
    uniform = ScissorhandsCache(model, ScissorhandsConfig(budget=18))
    every = ScissorhandsCache(model, ScissorhandsConfig(budget=18, head_budgets=path, retrieval_share=1.0))
    assert not any(isinstance(layer.kv, HeadGroups) for layer in every.budgeted_layers)
    assert torch.equal(greedy(model, ids, uniform).sequences, greedy(model, ids, every).sequences)


def test_a_budget_covering_the_sequence_is_the_full_cache(tmp_path):
    model = tiny_model("qwen2")
    ids = left_padded([30], seed=7)[0]
    path = ranking(tmp_path / "h.json", [[0.2, 0.1], [0.3, 0.4]])
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=80, head_budgets=path, retrieval_share=0.5,
                                                        head_window=60))
    assert all(isinstance(layer.kv, HeadGroups) for layer in cache.budgeted_layers)
    a, b = greedy(model, ids, cache, 25), greedy(model, ids, DynamicCache(config=model.config), 25)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_every_head_holds_its_own_budget_window_and_sinks_every_step(tmp_path):
    model = tiny_model("qwen2")
    budget, sinks = 20, 1
    path = ranking(tmp_path / "h.json", [[0.9, 0.1], [0.2, 0.3]])
    config = ScissorhandsConfig(budget=budget, sinks=sinks, recent=4, head_budgets=path, retrieval_share=0.5,
                                head_window=9)
    # 4 KV heads at 20 tokens = 80; the two streaming heads hold 9 each, the two retrieval heads (81) // 2 = 31.
    assert head_budgets(retrieval_heads([[0.9, 0.1], [0.2, 0.3]], 0.5), [budget] * 2, [9] * 2) == [[31, 9], [9, 31]]
    cache = ScissorhandsCache(model, config, audit=(audit := EvictionAudit()))
    ids = left_padded([33], seed=8)[0]
    with torch.no_grad():
        model(ids, cache=cache)
        for step in range(40):
            for layer in cache.budgeted_layers:
                groups = layer.kv
                assert groups.head_budgets() == ([31, 9] if layer.layer_idx == 0 else [9, 31])
                seen = int(groups.slots.seen[0])
                for heads, kv in zip(groups.heads, groups.parts):
                    stored = kv.slots.row(0)  # (heads, stored)
                    assert stored.shape[1] <= kv.budget
                    streaming = kv.method.name == "streaming"
                    keep = set(range(min(seen, 4 if streaming else sinks)))
                    keep |= set(range(max(0, seen - kv.recent), seen))
                    for row in stored:
                        assert keep <= set(row.tolist()), (layer.layer_idx, heads, step)
                        if streaming:  # sinks and the newest tokens only, nothing between
                            assert sorted(row.tolist()) == sorted(set(range(4)) | set(range(seen - len(row) + 4,
                                                                                              seen)))
            nxt = torch.randint(3, 200, (1, 1), generator=torch.Generator().manual_seed(step))
            model(nxt, cache=cache)
    # The audit hears every group in the layer's head numbering: evicted + stored = seen, head by head.
    for layer in cache.budgeted_layers:
        held = (layer.stored_positions(0) >= 0).sum(dim=1)
        assert torch.equal(audit.evicted[layer.layer_idx][0] + held, torch.full_like(held, int(layer.slots.seen[0])))
    # The memory saved is real: the groups hold no more K/V than the uniform cache at this budget.
    uniform = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, sinks=sinks, recent=4))
    with torch.no_grad():
        model(torch.cat([ids, torch.randint(3, 200, (1, 40))], dim=1), cache=uniform)
    split, whole = cache.memory_report(), uniform.memory_report()
    assert split["budgeted_kv_bytes"] <= whole["budgeted_kv_bytes"]
    head_size = model.config.hidden_size // model.config.num_attention_heads
    assert split["kv_data_bytes"] == sum(4 * 2 * head_size * b for b in (31, 9, 9, 31))  # float32 K and V
    mean = [float((layer.stored_positions(0) >= 0).sum()) / 2 for layer in cache.budgeted_layers]
    assert held_tokens(cache)["kv_held"] == sum(mean) / len(mean) <= budget


def test_a_padded_batch_keeps_what_each_row_keeps_alone(tmp_path):
    model = tiny_model("llama")
    path = ranking(tmp_path / "h.json", [[0.5, 0.1], [0.2, 0.3]], model_type="llama", query_heads=4)
    config = ScissorhandsConfig(budget=16, recent=3, head_budgets=path, retrieval_share=0.5, head_window=8)
    batch_and_alone(model, config, [30, 22, 41])


def naive_scores(model, ids, sinks, recent, length):
    """The score by hand: every segment's attention probabilities from the model (``output_attentions``), summed
    outside the sinks and the recent window query by query, averaged over the group's query heads and queries."""
    model.set_attn_implementation("eager")
    try:
        kv = model.config.num_key_value_heads
        g = model.config.num_attention_heads // kv
        sums = [[0.0] * kv for _ in range(model.config.num_hidden_layers)]
        counted = 0
        for start in range(0, len(ids), length):
            seg = ids[start:start + length]
            if len(seg) <= sinks + recent:
                continue
            with torch.no_grad():
                att = model(torch.tensor([seg]), output_attentions=True).attentions
            for layer, a in enumerate(att):
                for q in range(a.shape[1]):
                    for t in range(sinks + recent, len(seg)):
                        sums[layer][q // g] += sum(float(a[0, q, t, s]) for s in range(sinks, t - recent + 1)) / g
            counted += len(seg) - sinks - recent
        return [[x / counted for x in row] for row in sums]
    finally:
        model.set_attn_implementation("sdpa")


def test_the_calibration_equals_the_naive_score_and_ranks_the_heads(tmp_path, capsys):
    folder = tmp_path / "tiny"
    save_tiny_model(folder, "qwen2")
    text = tmp_path / "code.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 12)
    out = tmp_path / "heads.json"
    assert main(["heads", "--model", str(folder), "--text", str(text), "--tokens", "150", "--length", "64",
                 "--sinks", "2", "--recent", "8", "--out", str(out)]) == 0
    assert "4 KV heads of 2 layers ranked on 150 tokens" in capsys.readouterr().err
    got = json.loads(out.read_text())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    ids = AutoTokenizer.from_pretrained(folder)(text.read_text(), add_special_tokens=False).input_ids[:150]
    want = naive_scores(model, ids, 2, 8, 64)
    assert got["tokens"] == 150 and got["layers"] == [0, 1] and got["kv_heads"] == 2 and got["query_heads"] == 6
    for row, ref in zip(got["scores"], want):
        assert row == pytest.approx(ref, abs=2e-6)
    # The file runs the cache it was measured for.
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24, head_budgets=str(out)))
    assert sum(isinstance(layer.kv, HeadGroups) for layer in cache.budgeted_layers) >= 1


def one_line_error(fn, said):
    with pytest.raises(ValueError) as e:
        fn()
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


def test_bad_input_is_one_line_naming_the_parameter(tmp_path, capsys):
    model = tiny_model("qwen2")
    path = ranking(tmp_path / "h.json", [[0.2, 0.1], [0.3, 0.4]])
    three = ranking(tmp_path / "three.json", [[0.2, 0.1]] * 3, layers=(0, 1, 2))
    wide = ranking(tmp_path / "wide.json", [[0.2, 0.1, 0.3], [0.3, 0.4, 0.1]])

    def cache(**given):
        return lambda: ScissorhandsCache(model, ScissorhandsConfig(**{"budget": 20, "head_budgets": path, **given}))

    for bad, said in [(three, "head_budgets: the ranking was measured on another model"),
                      (wide, "head_budgets: the ranking was measured on another model"),
                      (str(tmp_path / "none.json"), "head_budgets: no such file"),
                      (str(tmp_path / "h.txt"), "head_budgets: must be a .json file")]:
        one_line_error(cache(head_budgets=bad), said)
    (tmp_path / "junk.json").write_text("[1, 2]")
    one_line_error(cache(head_budgets=str(tmp_path / "junk.json")), "head_budgets: ")
    for share in (0, 0.0, -0.5, 1.5, float("nan")):
        one_line_error(cache(retrieval_share=share), "retrieval_share: ")
    one_line_error(cache(head_window=20), "head_window: a streaming head's window (20) must be < its layer's budget")
    one_line_error(cache(head_window=4), "head_window: must be >= 8")
    one_line_error(lambda: CacheSettings(retrieval_share=0.5), "retrieval_share: a setting of head_budgets")
    for given, name in [({"prefill": "keep-prompt"}, "prefill"), ({"decode": "static"}, "decode"),
                        ({"merge": True}, "merge"), ({"kv_bits": 2, "kv_demote": "4:0.5"}, "kv_demote")]:
        one_line_error(cache(**given), f"head_budgets: cannot be combined with {name}=")
    one_line_error(lambda: ScissorhandsCache.for_memory(model, 0.5, 64, CacheSettings(head_budgets=path)),
                   "head_budgets: cannot be combined with memory=")
    # The command line says the same in one line.
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--prompt", "x", "--budget", "20",
                 "--head-budgets", path, "--retrieval-share", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: retrieval-share: must be in (0, 1]" in err and len(err.splitlines()) == 1, err
    assert main(["heads", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "h.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: out: must be a .json file" in err and len(err.splitlines()) == 1, err


def test_the_exact_scorer_runs_the_streaming_heads_under_a_budget_that_covers_the_text(tmp_path):
    """A budget above the length is the full cache only when no head keeps less: the scorer builds the cache."""
    from conftest import scored_and_decoded
    from scissorhands.core.methods import get_method
    from scissorhands.hf.scoring import ScoreSetup

    model = tiny_model("qwen2")
    path = ranking(tmp_path / "h.json", [[0.2, 0.1], [0.3, 0.4]])
    setup = ScoreSetup(get_method("scissorhands"), 60, CacheSettings(head_budgets=path, head_window=10))
    context, cont = list(range(3, 33)), list(range(40, 52))
    scored, decoded, cache = scored_and_decoded(model, context, cont, setup)
    assert isinstance(cache, ScissorhandsCache) and scored == pytest.approx(decoded, abs=1e-4)
    assert max(len(set(h.tolist()) - {-1}) for h in cache.budgeted_layers[0].stored_positions(0)) <= 10


def test_an_eval_cell_is_keyed_by_the_ranking_it_ran(tmp_path):
    """Two rankings at one path are two cells: the key holds the file's digest beside its name."""
    from scissorhands.core.methods import get_method
    from scissorhands.tools.eval.records import run_key

    path = ranking(tmp_path / "h.json", [[0.2, 0.1], [0.3, 0.4]])

    def key():
        return run_key({"name": "m"}, {"name": "t"}, get_method("scissorhands"), 190,
                       CacheSettings(head_budgets=path), 50, 0)

    first = key()
    assert first["settings"]["head_budgets"] == path and "head_budgets_sha256" in first["files"]
    ranking(tmp_path / "h.json", [[0.1, 0.2], [0.3, 0.4]])
    assert key() != first and run_key({"name": "m"}, {"name": "t"}, get_method("scissorhands"), 190,
                                      CacheSettings(), 50, 0)["files"] == {}
