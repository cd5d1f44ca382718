"""Demotion before eviction (``kv_demote``): the tiered store against the naive reference and the packed store."""

import pytest
import torch
from driver import CoreLayer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_stream
from test_reference import chunk_mask, kept_of, make_inputs

from scissorhands.core.attend.prefill import Streamed
from scissorhands.core.methods.scissorhands import Scissorhands
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.core.stores import make_store
from scissorhands.core.stores.packed import PackedKVStore
from scissorhands.core.stores.tiered import TieredKVStore
from scissorhands.core.tokens.importance import ImportanceState

# (widths above the base, widest first; the base): every kind of chain the store takes.
CHAINS = [((4,), 2), ((16, 4), 2), ((8, 4), 2), ((16,), 4), ((8,), 4), ((16, 8, 4), 2)]


@st.composite
def tier_cases(draw):
    widths, base = draw(st.sampled_from(CHAINS))
    b = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2]))
    t = draw(st.integers(1, 40))
    recent = draw(st.integers(0, 4))
    drop = draw(st.integers(1, 4))
    # Caps: the first holds the recent window and a drop; each later one at least the one before; the last
    # leaves at least a drop at the base.
    caps, low = [], recent + drop
    for _ in widths:
        cap = draw(st.integers(low, low + 6))
        caps.append(cap)
        low = cap
    budget = draw(st.integers(caps[-1] + drop, caps[-1] + drop + 8))
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    bucket_steps = None if window is None else draw(st.one_of(st.none(), st.integers(1, 5)))
    importance = draw(st.sampled_from(["sum", "count", "mean"]))
    pads = [draw(st.integers(0, t - 1)) for _ in range(b)]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(t - 1, 1)), max_size=5))) - {t}) if t > 1 else []
    chunks = [y - x for x, y in zip([0] + cuts, cuts + [t])]
    sinks = draw(st.integers(0, 2))
    room = max(drop, budget - recent - sinks)  # the most a layer's prefill drop may be (the settings clamp it)
    prefill_drop = draw(st.one_of(st.none(), st.integers(drop, min(drop + 3, room))))
    if prefill_drop is not None:  # a prompt, then decoding: the prefill drop applies to the prompt's events
        chunks = [chunks[0]] + [1] * (t - chunks[0])
    return dict(b=b, h_kv=h_kv, group=group, t=t, recent=recent, budget=budget, drop=drop, window=window,
                bucket_steps=bucket_steps, importance=importance, pads=pads, chunks=chunks, sinks=sinks,
                tiers=list(zip(widths, caps)), base=base, seed=draw(st.integers(0, 2**16)),
                tile=draw(st.integers(1, 8)), prefill_drop=prefill_drop)


def tiered_layer(case, read_tile=512):
    budget = case["budget"]
    # Shares chosen so that the layer's rounding gives back each cap exactly.
    store = TieredKVStore(case["base"], [(w, cap / budget) for w, cap in case["tiers"]], group_size=4,
                          read_tile=read_tile)
    steps = None if case["window"] is None else (case["bucket_steps"] or 1)
    n_buckets = 1 if case["window"] is None else -(-case["window"] // steps)
    state = ImportanceState(case["importance"], steps, n_buckets, False)
    return CoreLayer(budget, case["recent"], case["drop"], state, Scissorhands(), store=store,
                     query_tile=case["tile"], sinks=case["sinks"], prefill=Streamed(case["prefill_drop"]))


def run(case, layer, q, k, v, valid):
    outs, i = [], 0
    caps = layer.kv.tiers.tier_caps
    for c in case["chunks"]:
        vc = valid[:, i:i + c]
        mask = None if bool(vc.all()) else chunk_mask(vc)
        outs.append(layer.attend(q[:, :, i:i + c], k[:, :, i:i + c], v[:, :, i:i + c], mask, 0.5))
        # Invariants between chunks: the budget, every width's cap, in every KV head.
        assert int(layer.slots.lengths.max()) <= case["budget"]
        for pool, cap in zip(layer.kv.tiers.pools, caps):
            assert int(pool.used.sum(-1).max()) <= cap
        i += c
    return torch.cat(outs, dim=2)


def reference_for(case, q, k, v, valid, widths_out=None):
    return reference_stream(q, k, v, valid, budget=case["budget"], recent=case["recent"], drop=case["drop"],
                            window=case["window"], bucket_steps=case["bucket_steps"],
                            importance=case["importance"], scaling=0.5, sinks=case["sinks"],
                            prefill=case["chunks"][0], prefill_drop=case["prefill_drop"], tiers=case["tiers"],
                            base_bits=case["base"], group=4, widths_out=widths_out)


def stored_widths(layer, b_size, h_kv):
    tiers = layer.kv.tiers
    out = {}
    for b in range(b_size):
        n = int(layer.slots.lengths[b])
        w = tiers.slot_widths(layer.slots.length)[b, :, :n]
        out[b] = {h: w[h].tolist() for h in range(h_kv)}
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tier_cases())
def test_tiered_layer_matches_the_reference(case):
    """Which tokens are kept, at which width, and every query's output: the fast layer is the naive reference."""
    q, k, v, valid = make_inputs(case)
    widths = {}
    ref_out, ref_kept = reference_for(case, q, k, v, valid, widths)
    layer = tiered_layer(case)
    out = run(case, layer, q, k, v, valid)
    assert kept_of(layer, case["b"], case["h_kv"]) == ref_kept
    assert stored_widths(layer, case["b"], case["h_kv"]) == widths
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert torch.all(out.transpose(1, 2)[~valid] == 0)


def test_the_recent_window_stays_at_the_top_width_and_only_base_tokens_are_evicted():
    case = dict(b=1, h_kv=2, group=2, t=60, recent=3, budget=20, drop=2, window=None, bucket_steps=None,
                importance="sum", pads=[0], chunks=[1] * 60, sinks=0, tiers=[(16, 6), (4, 12)], base=2, seed=5,
                tile=4, prefill_drop=None)
    q, k, v, valid = make_inputs(case)
    layer = tiered_layer(case)
    dropped_widths = []
    for i in range(60):
        before = {h: dict(zip(layer.stored_positions(0)[h].tolist(),
                              layer.kv.tiers.slot_widths(layer.slots.length)[0, h].tolist()))
                  for h in range(2)} if i else {0: {}, 1: {}}
        run(dict(case, chunks=[1]), layer, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], valid[:, i:i + 1])
        widths = layer.kv.tiers.slot_widths(layer.slots.length)[0]
        assert widths[:, -min(3, i + 1):].eq(16).all()  # the newest three at full precision
        for h in range(2):
            now = set(layer.stored_positions(0)[h].tolist())
            dropped_widths += [w for p, w in before[h].items() if p not in now]
    assert dropped_widths and set(dropped_widths) == {2}  # evicted only once demoted to the bottom
    counts = [int((widths == w).sum()) for w in (16, 4, 2)]
    assert counts[0] <= 2 * 6 and counts[0] + counts[1] <= 2 * 12 and sum(counts) == 2 * 20


def test_a_chain_of_widths_adds_no_compression_events():
    """Widths whose caps are multiples of the drop fill in step with the budget: a streamed prefill through a
    chain of two widths makes as many events as the same layer with no tiers (one per drop tokens), in every
    KV head. Taking a wider token along when demoting a narrower width (the rule before) would leave the heads'
    counts apart, and events would then come every token or two."""
    case = dict(b=1, h_kv=4, group=1, t=240, recent=10, budget=40, drop=4, window=None, bucket_steps=None,
                importance="mean", pads=[0], chunks=[240], sinks=0, tiers=[(16, 16), (4, 28)], base=2, seed=3,
                tile=16, prefill_drop=None)
    q, k, v, valid = make_inputs(case)
    events = {}
    for name, tiers in (("tiered", case["tiers"]), ("plain", None)):
        layer = tiered_layer(case) if tiers else CoreLayer(  # the same layer, packed: eviction alone
            case["budget"], case["recent"], case["drop"], ImportanceState("mean", None, 1, False), Scissorhands(),
            store=PackedKVStore(2, group_size=4), query_tile=16)
        calls = []
        compress = layer.kv.compress
        layer.kv.compress = lambda rows, drop=None, calls=calls, compress=compress: (calls.append(1),
                                                                                      compress(rows, drop))
        layer.attend(q, k, v, None, 0.5)
        events[name] = len(calls)
    assert events["plain"] == (240 - 40) // 4
    assert events["tiered"] == (240 - 16) // 4  # from the first full width on, one event per drop tokens


def test_bytes_are_counted_exactly():
    """The pools at their caps, the base plane and scales for every slot, the indices and occupancy maps."""
    store = TieredKVStore(2, "16:0.25,4:0.5", group_size=8)
    store.bind(40, 4, 2)
    assert store.tier_caps == (10, 20)
    k = torch.randn(3, 2, 5, 16)
    store.allocate(k, k)
    store.resize(40)
    b, h, d = 3, 2, 16
    base = 2 * b * h * 40 * (d * 2 // 8)
    scales = 2 * b * h * 40 * (d // 8) * 2 * 2
    dense_pool = 2 * b * h * 10 * d * 4
    plane_pool = 2 * b * h * 20 * (d * 2 // 8)
    index = 2 * b * h * 40 * 2  # int16 per slot per pool
    used = b * h * (10 + 20)
    assert store.data_bytes() == base + dense_pool + plane_pool
    assert store.nbytes() == base + scales + dense_pool + plane_pool + index + used


def test_a_demoted_token_reads_as_a_quantisation_at_its_width():
    """A 4-bit code cut to 2 bits reads back within a 2-bit step's half of the value: no second rounding."""
    store = TieredKVStore(2, "4:0.5", group_size=8)
    store.bind(8, 1, 1)
    x = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    store.allocate(x, x)
    store.resize(8)
    store.write(0, x, x)
    exact4 = store.read(4)[0]
    store.demote(0, torch.ones(1, 1, 4, dtype=torch.bool))
    two = store.read(4)[0]
    step4 = store.plane.scale_k[:, :, :4].float()  # (1, 1, 4, 1): one group of 8 channels per token, the 4-bit step
    assert torch.all((exact4 - x).abs() <= step4 / 2 * (1 + 1e-3))
    # The 2-bit bins are 4 steps wide and read at their centre: within 2 steps of the value.
    assert torch.all((two - x).abs() <= 2 * step4 * (1 + 1e-3))
    assert not torch.equal(two, exact4)
    assert int(store.pools[0].used.sum()) == 0  # the demotion freed the plane entries


@pytest.mark.parametrize("kwargs,param", [
    (dict(kv_bits=2, kv_demote="8:0.5"), "kv_demote"),
    (dict(kv_bits=4, kv_demote="4:0.5"), "kv_demote"),
    (dict(kv_demote="4:0.5"), "kv_demote"),
    (dict(kv_bits=8, kv_demote="16:0.5"), "kv_demote"),
    (dict(kv_bits=2, kv_demote="4:0.6,8:0.2"), "kv_demote"),
    (dict(kv_bits=2, kv_demote="16:0.6,4:0.2"), "kv_demote"),
    (dict(kv_bits=2, kv_demote="4:1.5"), "kv_demote"),
    (dict(kv_bits=2, kv_demote="4"), "kv_demote"),
    (dict(kv_bits=2, kv_demote="4:0.5", kv_key_bits=8), "kv_key_bits"),
    (dict(kv_bits=2, kv_demote="4:0.5", kv_store="packed"), "kv_demote"),  # the tiered store's setting
    (dict(kv_bits=2, kv_demote="4:0.5", prefill="prompt-aware"), "kv_demote"),
])
def test_bad_demotion_settings_are_one_line_errors(kwargs, param):
    with pytest.raises(ValueError) as err:
        CacheSettings(**kwargs)
    assert str(err.value).startswith(f"{param}:") and "\n" not in str(err.value)


def test_a_share_too_small_for_the_recent_window_names_kv_demote():
    with pytest.raises(ValueError, match=r"^kv_demote: the 4-bit share holds 2 tokens .* at least 0\.300"):
        make_store(ScissorhandsConfig(budget=20, kv_bits=2, kv_demote="4:0.1", recent=4, drop=2), None, 0) \
            .bind(20, 4, 2)


def test_memory_takes_the_demotion_chain_where_its_measured_curve_is_lowest():
    """On a SmolLM2-135M-shaped float32 cache at 2,048 tokens, a fifth of the bytes leaves room beyond a 4-bit
    cache of the whole sequence: the frontier's 8 → 4 chain measured lowest there, and memory= takes it."""
    from scissorhands.core.planning.memory_target import Shape, choose, load_frontier

    shape = Shape(layers=30, kv_heads=3, head_dim_k=64, head_dim_v=64, itemsize=4)
    chain = next(f for f in load_frontier() if f.kv_demote)
    choice = choose(0.2, shape, 2048, CacheSettings())
    assert choice.family == chain.name and choice.config.kv_demote == chain.kv_demote
    assert choice.peak_bytes <= choice.target_bytes and "demotion" in choice.describe()
    others = [f for f in load_frontier() if not f.kv_demote]
    assert choose(0.2, shape, 2048, CacheSettings(), frontier=others).predicted_delta_nll > choice.predicted_delta_nll
    # A prompt-aware prefill cannot demote: the chain is skipped, not an error.
    assert choose(0.2, shape, 2048, CacheSettings(prefill="prompt-aware")).config.kv_demote is None


def test_a_demotion_re_packs_nothing(monkeypatch):
    """Decoding with demotions packs each token once per plane when it is written, and never again: a
    demotion only frees pool entries (the issue's bound is one re-pack per evicted batch; this is zero)."""
    from scissorhands.core.stores import pools, tiered

    calls = []
    real = tiered.pack
    for module in (tiered, pools):  # the pools' planes, and the base plane every slot holds
        monkeypatch.setattr(module, "pack", lambda q, bits: calls.append(q.shape) or real(q, bits))
    case = dict(b=1, h_kv=2, group=1, t=50, recent=2, budget=16, drop=2, window=None, bucket_steps=None,
                importance="sum", pads=[0], chunks=[1] * 50, sinks=0, tiers=[(8, 6), (4, 11)], base=2, seed=3,
                tile=4, prefill_drop=None)
    q, k, v, valid = make_inputs(case)
    layer = tiered_layer(case)
    run(case, layer, q, k, v, valid)
    assert layer.kv.compressions > 10
    # Per token: the base plane and the two pools' planes, for K and for V.
    assert len(calls) == 50 * 3 * 2


def test_select_batch_moves_every_part_of_the_tiered_store_with_its_row():
    """Beam search reorders rows (repeats allowed): base planes, scales, pool entries and occupancy go along,
    so each new row reads exactly what its source row read."""
    store = TieredKVStore(2, "16:0.3,4:0.6", group_size=8)
    store.bind(20, 2, 2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 5, 8, generator=gen)
    store.allocate(x, x)
    store.resize(20)
    store.write(0, x, x)
    store.demote(1, torch.tensor([True, False, True, False, False]).expand(3, 2, 5))  # two slots to 2 bits
    store.demote(0, torch.tensor([False, True, False, False, False]).expand(3, 2, 5))  # one to 4 bits
    before = store.read(5)
    index = torch.tensor([2, 0, 0])
    store.select_batch(index)
    after = store.read(5)
    for a, b in zip(before, after):
        assert torch.equal(a[index], b)
    assert torch.equal(store.slot_widths(5)[0, 0], torch.tensor([2, 4, 2, 16, 16], dtype=torch.int16))
    assert store.head_counts()[:, :, 0].eq(2).all() and store.head_counts()[:, :, 1].eq(3).all()


def test_demotion_widths_are_integers_and_pairs_survive_lm_eval_comma_splitting():
    """``16:0.1;4:0.5`` is ``16:0.1,4:0.5`` (lm-eval splits its model arguments at commas); a width that is not
    an integer is refused, as a float is for every integer setting."""
    from scissorhands.core.settings.tiers import parse_tiers

    assert parse_tiers("16:0.1;4:0.5") == parse_tiers("16:0.1,4:0.5") == ((16, 0.1), (4, 0.5))
    for bad in ([(8.7, 0.3)], [(8.0, 0.3)], [(True, 0.3)], "8.7:0.3"):
        with pytest.raises(ValueError, match="^kv_demote: "):
            CacheSettings(kv_bits=4, kv_demote=bad)
    with pytest.raises(ValueError, match="^kv_store: 'dense'"):
        CacheSettings(kv_bits=4, kv_store="dense")
