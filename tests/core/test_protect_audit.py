"""Protected spans and the eviction audit: against the naive reference, and through real models."""

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_stream
from test_reference import chunk_mask, make_inputs
from transformers import AutoModelForCausalLM

from conftest import byte_tokenizer_fast, save_tiny_model
from scissorhands import EvictionAudit, Protection, ScissorhandsCache, ScissorhandsConfig, get_method
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.protect import check_room
from scissorhands.hf.cache import ScissorhandsLayer
from scissorhands.tools.cli import main
from scissorhands.tools.generation import generate

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"))
    tok = byte_tokenizer_fast()
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_tokenizer_model(tiny_model_dir):
    from scissorhands.tools.models import load_model

    return load_model(str(tiny_model_dir))


def run_protected(case, protect, audit):
    q, k, v, valid = make_inputs(case)
    window, steps = case["window"], case["bucket_steps"]
    n_buckets = 1 if window is None else math.ceil(window / (steps or 1))
    state = ImportanceState(case["importance"], None if window is None else (steps or 1), n_buckets, False)
    layer = ScissorhandsLayer(case["budget"], case["recent"], case["drop"], state, Scissorhands(),
                              query_tile=case["tile"], protect=Protection(protect))
    layer.kv.listeners.append(audit)
    audit.attach(0)
    i = 0
    for c in case["chunks"]:
        layer.update(k[:, :, i:i + c], v[:, :, i:i + c], kwargs={})
        vc = valid[:, i:i + c]
        layer.attend(q[:, :, i:i + c], k[:, :, i:i + c], v[:, :, i:i + c], None if bool(vc.all()) else chunk_mask(vc),
                     0.5)
        assert int(layer.slots.lengths.max()) <= case["budget"]
        i += c
    return (q, k, v, valid), layer


@st.composite
def protected_cases(draw):
    b = draw(st.integers(1, 3))
    t = draw(st.integers(2, 40))
    recent = draw(st.integers(0, 4))
    budget = draw(st.integers(recent + 2, recent + 16))
    drop = draw(st.integers(1, budget - recent - 1))
    room = budget - recent - drop
    protect = []
    for _ in range(b):
        spans, used = [], 0
        for _ in range(draw(st.integers(0, 2))):
            start = draw(st.integers(0, t))
            length = draw(st.integers(1, max(1, room - used)))
            if used + length > room:
                break
            spans.append((start, start + length))
            used += length
        protect.append(spans)
    pads = [draw(st.integers(0, t - 1)) for _ in range(b)]
    cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=4))))
    window = draw(st.one_of(st.none(), st.integers(1, 10)))
    return dict(b=b, h_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])), t=t, recent=recent,
                budget=budget, drop=drop, window=window, bucket_steps=None,
                importance=draw(st.sampled_from(["sum", "count", "mean"])), pads=pads,
                chunks=[y - x for x, y in zip([0] + cuts, cuts + [t])], tile=draw(st.integers(1, 6)),
                seed=draw(st.integers(0, 2**16)), protect=protect)


def events_of(audit, layer=0):
    table = audit.event_table(layer)
    return sorted(zip(table["row"], table["head"], table["step"], table["position"]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(protected_cases())
def test_protection_and_audit_match_the_reference(case):
    audit = EvictionAudit(events=True)
    (q, k, v, valid), layer = run_protected(case, case["protect"], audit)
    ref_events: list = []
    _, ref_kept = reference_stream(q, k, v, valid, budget=case["budget"], recent=case["recent"], drop=case["drop"],
                                   window=case["window"], bucket_steps=None, importance=case["importance"],
                                   scaling=0.5, protect=case["protect"], events=ref_events)
    kept = [[layer.stored_positions(b)[h].tolist() for h in range(case["h_kv"])] for b in range(case["b"])]
    assert kept == ref_kept
    # The audit saw exactly the reference's evictions: same rows, heads, steps and positions ...
    assert events_of(audit) == sorted((b, h, step, pos) for b, h, step, pos, _ in ref_events)
    # ... with the importance the selection used.
    table = audit.event_table(0)
    got = {(r, h, s, p): x for r, h, s, p, x in zip(table["row"], table["head"], table["step"], table["position"],
                                                   table["importance"])}
    for b, h, step, pos, score in ref_events:
        assert got[(b, h, step, pos)] == pytest.approx(score, rel=1e-6, abs=1e-9)
    # Protected positions that were seen are still held by every head.
    seen = valid.sum(dim=1).tolist()
    for b, spans in enumerate(case["protect"]):
        must = {p for lo, hi in spans for p in range(lo, min(hi, seen[b]))}
        for h in range(case["h_kv"]):
            assert must <= set(kept[b][h])
    # Counters agree with the events.
    assert int(audit.evicted[0].sum()) == len(ref_events) if ref_events else 0 not in audit.evicted


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


def test_generate_with_protection_and_audit_writes_json_and_png(tmp_path, tiny_tokenizer_model):
    model, tok = tiny_tokenizer_model
    audit = EvictionAudit(spans={"head": (0, 6)})
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    result = generate(model, tok, prompt, ScissorhandsConfig(budget=24), max_new_tokens=8, protect=[(0, 6)],
                      audit=audit, ignore_eos=True)
    assert result.memory["peak_stored"] <= 24
    summary = audit.summary(result.cache)
    assert all(v == 1.0 for v in summary["spans"]["head"]["held_fraction"].values())
    assert summary["spans"]["head"]["first_evicted_step_any_layer"] is None
    record = audit.to_json(tmp_path / "audit.json", result.cache)
    assert json.loads((tmp_path / "audit.json").read_text())["spans"] == json.loads(json.dumps(record["spans"]))


def test_cli_protect_prefix_and_audit(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "audit.json"
    prompt = "word " * 80
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "24", "--prompt", prompt,
                 "--max-new-tokens", "4", "--ignore-eos", "--protect-prefix", "5", "--audit", str(out),
                 "--audit-events"])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["spans"]["protected"]["first_evicted_step_any_layer"] is None
    assert record["spans"]["prompt"]["first_evicted_step_any_layer"] is not None
    assert all(len(t["step"]) == sum(record["evicted"][k]) for k, t in record["events"].items())
    assert out.with_suffix(".png").stat().st_size > 1000
    err = capsys.readouterr().err
    assert "[audit] prompt 0-" in err and "protected 0-5: 100% held (layer min 100%), never evicted" in err


def test_cli_protect_system_pins_the_system_turn(tmp_path, capsys, tiny_model_dir):
    out = tmp_path / "audit.json"
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "40", "--system", "code 12345",
                 "--protect-system", "--prompt", "word " * 60, "--max-new-tokens", "4", "--ignore-eos",
                 "--audit", str(out)])
    assert code == 0, capsys.readouterr().err
    spans = json.loads(out.read_text())["spans"]
    n_system = len("<system>code 12345</system>\n")  # one token per byte
    assert spans["system"]["end"] == spans["protected"]["end"] == n_system
    assert spans["system"]["first_evicted_step_any_layer"] is None
    assert all(v == 1.0 for v in spans["system"]["held_fraction"].values())
    assert spans["prompt"]["first_evicted_step_any_layer"] is not None


@pytest.mark.parametrize("args,message", [
    (["--protect-prefix", "-1"], "protect-prefix: must be >= 1"),
    (["--protect-prefix", "40"], "protect-prefix: 40 protected tokens do not fit"),
    (["--protect-system"], "protect-system: needs --system"),
    (["--audit-events"], "audit-events: needs --audit"),
])
def test_cli_bad_protection_is_one_line(args, message, capsys, tiny_model_dir):
    code = main(["generate", "--model", str(tiny_model_dir), "--budget", "24", "--prompt", "word " * 30,
                 "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err
