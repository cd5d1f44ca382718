"""Protected spans and the eviction audit through real models (against the naive reference:
tests/core/test_protect_audit.py)."""

import pytest
import torch
from test_protect_audit import events_of
from transformers import AutoModelForCausalLM

from scissorhands import EvictionAudit, Protection, ScissorhandsCache, ScissorhandsConfig, get_method
from scissorhands.core.tokens.protect import check_room


def tiny(arch="llama", layers=3):
    from transformers import Gemma3TextConfig, LlamaConfig

    torch.manual_seed(0)
    if arch == "gemma3":
        cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention", "full_attention"][:layers],
                               max_position_embeddings=1024)
    else:
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("prefill", ["stream", "prompt-aware"])
def test_protected_spans_survive_generation_in_every_layer_and_head(arch, prefill):
    model = tiny(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding: row 1 has 73 real tokens
    protect = [[(5, 12), (60, 66)], [(0, 4), (30, 41)]]
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=32, prefill=prefill), protect=protect)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=20, do_sample=False,
                       pad_token_id=0)
    layers = cache.budgeted_layers
    assert layers and all(layer.compressions > 0 for layer in layers)
    for layer in layers:
        assert int(layer.slots.lengths.max()) <= 32  # (a prompt-aware prefill holds the prompt once, by design)
        for row, spans in enumerate(protect):
            held = layer.stored_positions(row)  # (H_kv, stored)
            for lo, hi in spans:
                for p in range(lo, hi):
                    assert bool((held == p).any(dim=-1).all()), (layer.layer_idx, row, p)


def test_protection_changes_nothing_but_what_it_pins():
    """Without pressure on the protected span, results equal the unprotected cache; with it, the span stays."""
    model = tiny()
    ids = torch.randint(3, 128, (1, 60))
    plain = ScissorhandsCache(model, ScissorhandsConfig(budget=100))
    pinned = ScissorhandsCache(model, ScissorhandsConfig(budget=100), protect=[(0, 20)])
    with torch.no_grad():
        a = model(ids, cache=plain).logits
        b = model(ids, cache=pinned).logits
    assert torch.equal(a, b)  # budget >= length: nothing is evicted either way


def test_streaming_llm_is_protect_plus_recent():
    """StreamingLLM = the local (recency) method with the first 4 tokens protected."""
    model = tiny()
    ids = torch.randint(3, 128, (2, 80))
    settings = get_method("streaming").resolve(ScissorhandsConfig(budget=24, preset="paper").settings)
    caches = [ScissorhandsCache(model, settings.with_budget(24), get_method("streaming")()),
              ScissorhandsCache(model, settings.with_budget(24), get_method("local")(), protect=[(0, 4)])]
    logits = []
    with torch.no_grad():
        for cache in caches:
            logits.append(model(ids, cache=cache).logits)
    assert torch.equal(logits[0], logits[1])
    for la, lb in zip(caches[0].budgeted_layers, caches[1].budgeted_layers):
        assert torch.equal(la.stored_positions(0), lb.stored_positions(0))


def test_over_full_protection_is_refused():
    model = tiny()
    with pytest.raises(ValueError, match=r"^protect: 30 protected tokens do not fit: a layer budget of 40 .*"
                                         r"at most \d+ protected tokens$"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=40), protect=[(0, 30)])
    with pytest.raises(ValueError, match=r"protect: 30 protected tokens \(sequence 1\)"):
        ScissorhandsCache(model, ScissorhandsConfig(budget=40), protect=[[(0, 4)], [(0, 20), (10, 30)]])
    # Overlaps count once: (0, 20) and (10, 30) cover 30 tokens, (0, 20) twice covers 20.
    ScissorhandsCache(model, ScissorhandsConfig(budget=40), protect=[(0, 20), (0, 20)])
    # The layer with least room decides (a schedule gives layers different budgets).
    with pytest.raises(ValueError, match="layer budget of 10"):
        check_room(Protection.prefix(5), [(40, 4, 2), (10, 2, 4)])


@pytest.mark.parametrize("spec,message", [
    ([(3, 3)], r"protect: a span needs 0 <= start < end \(end exclusive\), got \(3, 3\)"),
    ([(-1, 4)], r"protect: a span needs 0 <= start"),
    ([(0, 2.5)], r"protect: span bounds must be whole token positions"),
    ("0:4", r"protect: must be a list of \(start, end\) spans"),
    ([[(0, 4)], [(5,)]], r"protect: each span must be a \(start, end\) pair \(sequence 1\)"),
])
def test_bad_protection_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message):
        ScissorhandsCache(tiny(), ScissorhandsConfig(budget=40), protect=spec)


def test_per_sequence_spans_must_match_the_batch():
    model = tiny()
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=20), protect=[[(0, 2)], [(0, 2)], [(0, 2)]])
    with pytest.raises(ValueError, match=r"^protect: 3 per-sequence span lists for a batch of 2 sequences "
                                         r"\(a batch must hold each sequence the same number of times\)$"):
        with torch.no_grad():
            model(torch.randint(3, 128, (2, 30)), cache=cache)
    # A batch holding each sequence k times in place (beams, return sequences) repeats each list k times.
    spans = Protection.parse([[(0, 1)], [(2, 3)], [(4, 5)]])
    assert spans.for_batch(6).rows == [[(0, 1)], [(0, 1)], [(2, 3)], [(2, 3)], [(4, 5)], [(4, 5)]]
    assert spans.for_batch(3) is spans


@pytest.mark.parametrize("expand", [{"num_beams": 3}, {"num_return_sequences": 2, "do_sample": True},
                                    {"num_beams": 2, "num_return_sequences": 2}])
def test_per_sequence_spans_follow_beams_and_return_sequences(expand):
    """Per-sequence spans of a batch of 2 follow transformers' expansion of each sequence k times in place:
    every expanded row keeps its own sequence's spans, and the batch equals each sequence run alone."""
    model = tiny()
    torch.manual_seed(5)
    ids = torch.randint(3, 128, (2, 70))
    protect = [[(2, 9)], [(30, 41), (50, 52)]]
    kw = dict(max_new_tokens=12, pad_token_id=0, **expand)

    def run(input_ids, spans, seed=0):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24), protect=spans)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache, **kw)
        return out, cache

    out, cache = run(ids, protect)
    rows = cache.budgeted_layers[0].slots.lengths.shape[0]
    assert rows == 2 * max(expand.get("num_beams", 1), expand.get("num_return_sequences", 1))
    per = rows // 2
    for layer in cache.budgeted_layers:
        assert layer.compressions > 0
        for row in range(rows):
            held = layer.stored_positions(row)
            for lo, hi in protect[row // per]:
                assert bool(torch.isin(torch.arange(lo, hi), held).all()), (layer.layer_idx, row)
    if "do_sample" not in expand:  # deterministic: the batch equals each sequence alone
        for b in range(2):
            alone, _ = run(ids[b:b + 1], [protect[b]])
            assert torch.equal(out[b * (out.shape[0] // 2):(b + 1) * (out.shape[0] // 2)], alone)


def test_protection_and_audit_follow_reordered_rows():
    model = tiny()
    audit = EvictionAudit()
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=20), protect=[[(0, 1)], [(2, 3)]], audit=audit)
    with torch.no_grad():
        model(torch.randint(3, 128, (2, 40)), cache=cache)
    before = audit.evicted[0].clone()
    cache.reorder_cache(torch.tensor([1, 0, 0]))  # beam search / batch expansion
    for layer in cache.budgeted_layers:
        assert layer.kv.shields[0].rows == [[(2, 3)], [(0, 1)], [(0, 1)]]
    assert torch.equal(audit.evicted[0], before[[1, 0, 0]])


def test_batch_audit_equals_each_sequence_alone():
    model = tiny()
    torch.manual_seed(3)
    a, b = torch.randint(3, 128, (1, 70)), torch.randint(3, 128, (1, 55))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 15, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :15] = 0
    spans = {"start": (0, 10), "middle": (20, 40)}

    def audited(input_ids, attention_mask):
        audit = EvictionAudit(events=True, spans=spans)
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24), audit=audit)
        with torch.no_grad():
            model(input_ids, attention_mask=attention_mask, cache=cache)
        return audit, cache

    batch, batch_cache = audited(ids, mask)
    for row, alone_ids in enumerate([a, b]):
        alone, alone_cache = audited(alone_ids, torch.ones_like(alone_ids))
        for layer in alone.layers:
            assert batch.evicted[layer][row].tolist() == alone.evicted[layer][0].tolist()
            assert torch.equal(batch.span_first[layer][row], alone.span_first[layer][0])
            ev = batch.event_table(layer)
            mine = sorted((h, s, p) for r, h, s, p in zip(ev["row"], ev["head"], ev["step"], ev["position"])
                          if r == row)
            assert mine == [(h, s, p) for _, h, s, p in events_of(alone, layer)]
        assert batch.summary(batch_cache, row)["spans"] == alone.summary(alone_cache, 0)["spans"]


def test_summary_from_counters_equals_the_cache():
    model = tiny()
    audit = EvictionAudit(spans={"prompt": (0, 50), "tail": (40, 70)})  # both seen before the last eviction
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=24), audit=audit)
    with torch.no_grad():
        model(torch.randint(3, 128, (1, 80)), cache=cache)
    exact, counted = audit.summary(cache), audit.summary()
    for name in ("prompt", "tail"):
        for layer, frac in exact["spans"][name]["held_fraction"].items():
            assert counted["spans"][name]["held_fraction"][layer] == pytest.approx(frac)
        assert exact["spans"][name]["first_evicted_step_any_layer"] is not None
    assert 0 < exact["spans"]["prompt"]["held_fraction"][0] < 1
    with pytest.raises(ValueError, match="events were not recorded"):
        audit.event_table(0)
    with pytest.raises(ValueError, match="before the first eviction"):
        audit.watch("late", 0, 3)
