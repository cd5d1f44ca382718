"""A new eviction method, or a new K/V store, is one small class: these are defined here, registered, and
pass the shipped tests (scorer = token-by-token decoding; batch = each sequence alone).

Nothing outside this file changes for them. ``Coarse`` is a new prefill mode, chosen by name
(``prefill``) from the settings, the Python API and the command line. ``HalfStore`` keeps K/V in float16
under a float32 model and is chosen by name (``kv_store``), with and without the full-precision residual
wrapped around it.
``ValueWeighted`` reuses the windowed importance state and weighs it by the value norm; ``PeakAttention``
brings a per-token state of its own (the largest probability each token ever
received), which the layer keeps aligned with K/V through the state hooks.
"""

from dataclasses import dataclass, replace

import pytest
import torch
from test_scoring import BASE as SCORING_BASE
from test_scoring import assert_scorer_equals_decoding

from conftest import left_padded, tiny_model
from scissorhands import EvictionMethod, LayerView, ScissorhandsCache, ScissorhandsConfig, TokenState, register
from scissorhands.core.attend.prefill import PREFILLS, Prefill, Streamed, register_prefill, unregister_prefill
from scissorhands.core.layer.decode import DECODES, StaticDecode, register_decode, unregister_decode
from scissorhands.core.methods import METHODS, unregister
from scissorhands.core.settings.config import CacheSettings, readme_table
from scissorhands.core.settings.declare import OWNED, from_strings, one_of, parse_float, real, setting
from scissorhands.core.stores import DenseKVStore, KVStore, register_store, unregister_store
from scissorhands.core.tokens.importance import ImportanceState


class ValueWeighted(EvictionMethod):
    """Attention summed over the history window, times the token's value norm."""

    name = "test-value-weighted"
    description = "windowed attention x ||v||"

    def make_state(self, config):
        return ImportanceState.from_settings(config)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.state.scores(view.length) * view.values().float().norm(dim=-1)  # (B, H_kv, L)


class PeakState(TokenState):
    """The largest attention probability each stored token has received, per row and KV head."""

    wants_attention = True

    def __init__(self):
        self.reset()

    def reset(self):
        self.peak = None

    @property
    def allocated(self):
        return self.peak is not None

    def allocate(self, batch, heads, capacity, group, device, dtype):
        self.peak = torch.zeros(batch, heads, capacity, device=device)

    def resize(self, capacity):
        resized = self.peak.new_zeros(*self.peak.shape[:2], capacity)
        keep = min(capacity, self.peak.shape[-1])
        resized[..., :keep] = self.peak[..., :keep]
        self.peak = resized

    def clear(self, start, end):
        self.peak[..., start:end] = 0

    def clear_slots(self, rows, slots):
        self.peak[rows, :, slots] = 0

    def observe(self, probs, attended, steps, valid):
        seen = probs.amax(dim=(2, 3))  # (B, H_kv, L): over the group's heads and the new queries
        length = seen.shape[-1]
        self.peak[..., :length] = torch.maximum(self.peak[..., :length], seen)

    def compact(self, keep):
        self.peak[..., : keep.shape[-1]] = self.peak.gather(2, keep)

    def select_batch(self, index):
        self.peak = self.peak.index_select(0, index)

    def nbytes(self):
        return 0 if self.peak is None else self.peak.nbytes

    def bytes_per_token_head(self):
        return 4


class PeakAttention(EvictionMethod):
    name = "test-peak-attention"
    description = "the largest attention probability a token ever received"

    def make_state(self, config):
        return PeakState()

    def score(self, view: LayerView) -> torch.Tensor:
        return view.state.peak[..., : view.length]


@pytest.fixture(params=[ValueWeighted, PeakAttention])
def plugin(request):
    register(request.param)
    yield request.param
    unregister(request.param.name)


def test_plugin_passes_the_exactness_test_every_method_passes(plugin):
    assert METHODS[plugin.name] is plugin
    assert_scorer_equals_decoding(plugin.name)
    assert_scorer_equals_decoding(plugin.name, arch="gemma3")


def test_plugin_batch_equals_each_sequence_alone(plugin):
    model = tiny_model("llama", torch.float64)
    ids, mask = left_padded([30, 17], seed=4)
    config = ScissorhandsConfig(budget=12, recent=2, drop=3, window=6, window_buckets=None)

    def run(rows):
        cache = ScissorhandsCache(model, config, plugin())
        with torch.no_grad():
            out = model.generate(ids[rows], attention_mask=mask[rows], cache=cache, max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)
        return out[:, -8:], cache

    together, cache = run([0, 1])
    for row in range(2):
        alone, single = run([row])
        assert torch.equal(together[row], alone[0])
        for a, b in zip(cache.budgeted_layers, single.budgeted_layers):
            assert torch.equal(a.stored_positions(row), b.stored_positions(0))
    assert cache.memory_report()["peak_stored"] <= 12


def test_registry_rejects_unnamed_and_duplicate_methods():
    class Nameless(EvictionMethod):
        pass

    with pytest.raises(ValueError, match="needs a name"):
        register(Nameless)

    class Clash(EvictionMethod):
        name = "scissorhands"

    with pytest.raises(ValueError, match="already registered"):
        register(Clash)


class HalfStore(DenseKVStore):
    """K and V kept as float16 under a float32 model, read back in float32: a lossy store in a few lines.

    Each token is rounded once, when it is written, and an eviction moves the stored halves: the two
    properties the exact scorer needs, as the packed store has them. (float8 was tried first: its steps are
    so coarse that the last-bit difference between blocked and token-by-token K/V flips a rounding now and
    then, which moves a log-prob by 1e-4; float16's steps are 2**-11 relative.)
    """

    name = "test-fp16"
    read_tile = 8  # its reads are copies, so attention reads 8 slots at a time

    @staticmethod
    def _bytes(x):
        return x.to(torch.float16)

    def _real(self, x):
        return x.to(self.dtype)

    def allocate(self, key, value):
        super().allocate(self._bytes(key), self._bytes(value))
        self.dtype = key.dtype

    def write(self, start, key, value):
        super().write(start, self._bytes(key), self._bytes(value))

    def write_at(self, rows, slots, key, value):
        super().write_at(rows, slots, self._bytes(key), self._bytes(value))

    def read(self, length):
        keys, values = super().read(length)
        return self._real(keys), self._real(values)

    def read_keys(self, start, end):
        return self._real(self.keys[:, :, start:end])

    def read_values(self, start, end):
        return self._real(self.values[:, :, start:end])



@pytest.fixture
def half_store():
    register_store(HalfStore)
    yield HalfStore
    unregister_store(HalfStore.name)


@pytest.mark.parametrize("residual", [0, 3])
def test_a_new_store_passes_the_exactness_tests(half_store, residual):
    """Registered here, chosen by name, with and without the residual wrapped around it: the scorer equals
    token-by-token decoding, on Llama and on Gemma 3's sliding + global layers."""
    base = replace(SCORING_BASE, kv_store="test-fp16", kv_residual=residual)
    for arch in ("llama", "gemma3"):
        assert_scorer_equals_decoding("scissorhands", arch=arch, base=base)
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, base)
    store = cache.budgeted_layers[0].kv.store
    assert isinstance(store.inner if residual else store, HalfStore)
    with torch.no_grad():
        model(torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2)), cache=cache)
    report = cache.memory_report()
    # Two bytes per element, half the float32 cache; the residual's exact tokens on top when asked for.
    assert store.bytes_per_token_head() * 2 == (model.config.head_dim * 2) * 4  # float32 K and V: 4 bytes each
    assert (report["kv_residual_bytes"] > 0) == bool(residual)


def test_a_new_store_keeps_a_batch_equal_to_each_sequence_alone(half_store):
    model = tiny_model("llama")
    ids, mask = left_padded([30, 14], seed=5)
    config = ScissorhandsConfig(budget=12, recent=3, drop=4, kv_store="test-fp16")

    def run(rows):
        cache = ScissorhandsCache(model, config)
        with torch.no_grad():
            out = model.generate(ids[rows], attention_mask=mask[rows], cache=cache, max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)
        return out[:, -8:], cache

    together, cache = run([0, 1])
    assert cache.memory_report()["peak_stored"] <= 12
    for row in range(2):
        alone, single = run([row])
        assert torch.equal(together[row], alone[0])
        for a, b in zip(cache.budgeted_layers, single.budgeted_layers):
            assert torch.equal(a.stored_positions(row), b.stored_positions(0))


HALVES = ("float16", "bfloat16")


@dataclass(frozen=True)
class HalfFormat:
    """The setting of ``HalfOf``, declared here: which 2-byte float it rounds K/V to."""

    half_format: str = setting("float16", "test-half store: `float16` or `bfloat16`", str, one_of(HALVES))


class HalfOf(HalfStore):
    """``HalfStore`` with its 2-byte format as a setting of its own."""

    name = "test-half"
    Settings = HalfFormat

    def __init__(self, fmt="float16"):
        super().__init__()
        self.fmt = getattr(torch, fmt)

    @classmethod
    def from_settings(cls, settings, key_center=None):
        return cls(settings.half_format)

    def _bytes(self, x):
        return x.to(self.fmt)


def test_a_new_store_brings_a_setting_of_its_own():
    """A store registered here declares ``half_format``: a setting by name while ``kv_store`` names the store
    (each layer's store takes it), a one-line error naming it otherwise, unknown once the store is gone."""
    register_store(HalfOf)
    try:
        model = tiny_model("llama")
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, kv_store="test-half", half_format="bfloat16"))
        with torch.no_grad():
            model(torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(2)), cache=cache)
        assert {layer.kv.store.keys.dtype for layer in cache.budgeted_layers} == {torch.bfloat16}
        with pytest.raises(ValueError, match=r"^half_format: a setting of kv_store='test-half', got kv_store=None, "
                           r"which is 'dense' with these settings$"):
            CacheSettings(half_format="bfloat16")
        with pytest.raises(ValueError, match=r"^half_format: must be one of 'float16' or 'bfloat16', got 'float8'$"):
            CacheSettings(kv_store="test-half", half_format="float8")
    finally:
        unregister_store(HalfOf.name)
    with pytest.raises(TypeError):
        CacheSettings(half_format="bfloat16")


def test_a_plug_ins_setting_cannot_take_a_shared_name_or_another_plug_ins():
    """Two plug-ins' settings of one name would be ambiguous on the command line: refused when registered, and
    nothing of the refused plug-in is left registered."""

    @dataclass(frozen=True)
    class Clash:
        recent: int = setting(3, "clashes with a shared setting", int, lambda name, v: v)

    @dataclass(frozen=True)
    class Theirs:
        observe: int = setting(3, "clashes with prompt-aware's", int, lambda name, v: v)

    @dataclass(frozen=True)
    class Hidden:  # a method of the settings would answer for it
        with_budget: int = setting(3, "clashes with a method of the settings", int, lambda name, v: v)

    for settings, match in ((Clash, "^recent: already a name of the shared settings"),
                            (Hidden, "^with_budget: already a name of the shared settings"),
                            (Theirs, "^observe: already a setting of prefill='keep-prompt' or 'prompt-aware'")):
        mode = type("Clashing", (Streamed,), {"name": "test-clashing", "Settings": settings})
        with pytest.raises(ValueError, match=match):
            register_prefill(mode)
        assert "test-clashing" not in PREFILLS


def test_stores_are_checked_when_made_and_named():
    class Incomplete(KVStore):
        name = "test-incomplete"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    with pytest.raises(ValueError, match="kv_store"):
        ScissorhandsConfig(budget=12, kv_store="no-such-store")
    with pytest.raises(ValueError, match="already registered"):
        register_store(type("Clash", (DenseKVStore,), {"name": "packed"}))
    # The settings name the shipped stores without importing them (no torch); the two lists are one.
    from scissorhands.core.settings.config import STORE_NAMES
    from scissorhands.core.stores import STORES

    assert {n for n in STORES if not n.startswith("test-")} == set(STORE_NAMES)


@dataclass(frozen=True)
class CoarseSettings:
    """The one setting of ``Coarse``, declared here like any shipped setting (default, help, parse, check)."""

    coarse_share: float = setting(0.5, "test-coarse prefill: the share of a layer's budget each compression "
                                  "event makes room for", parse_float, real(0.01, 1.0), group="prefill")

    def check(self):
        if self.coarse_share == 0.75:  # a rule of the mode's own, run only when the mode is chosen
            raise ValueError("coarse_share: 0.75 is refused by this test's mode")


class Coarse(Streamed):
    """A prefill mode of this file's own: stream the prompt, but make room a share of a layer's budget at a time
    (few large compression events), whatever ``prefill_drop`` says. The share is its own setting."""

    name = "test-coarse"
    Settings = CoarseSettings
    made: list[int] = []

    @classmethod
    def from_settings(cls, settings, layer_budget=None):
        drop = None if layer_budget is None else max(1, int(layer_budget * settings.coarse_share))
        if drop is not None:
            cls.made.append(drop)
        return cls(drop)


@pytest.fixture
def coarse():
    register_prefill(Coarse)
    Coarse.made.clear()
    yield Coarse
    unregister_prefill(Coarse.name)


def test_a_new_prefill_mode_is_one_class_registered_from_outside(coarse, tmp_path, capsys):
    """Defined and registered in this file only: the settings take its name, each layer gets it, and it runs the
    prompt exactly as the shipped streamed prefill with the same drop does (equal tokens, equal kept positions,
    the budget held); the command line runs it too. Unregistered, its name is a one-line error again."""
    from scissorhands.tools import cli

    assert PREFILLS["test-coarse"] is Coarse
    model = tiny_model("llama", torch.float64)
    ids, mask = left_padded([40, 29], seed=6)
    budget = 16

    def run(**settings):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, recent=2, drop=2, **settings))
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        return out, cache

    mine, cache = run(prefill="test-coarse")
    shipped, reference = run(prefill="stream", prefill_drop=budget // 2)
    assert all(isinstance(layer.kv.prefill, Coarse) for layer in cache.budgeted_layers)
    assert Coarse.made and set(Coarse.made) == {budget // 2}
    assert torch.equal(mine, shipped)
    for a, b in zip(cache.budgeted_layers, reference.budgeted_layers):
        for row in range(2):
            assert torch.equal(a.stored_positions(row), b.stored_positions(row))
    assert cache.memory_report()["peak_stored"] <= budget
    _, plain = run(prefill="stream")  # the mode matters: one token's drop keeps other positions
    assert any(not torch.equal(a.stored_positions(0), b.stored_positions(0))
               for a, b in zip(cache.budgeted_layers, plain.budgeted_layers))

    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    Coarse.made.clear()
    code = cli.main(["generate", "--model", str(folder), "--budget", "16", "--recent", "2", "--prefill",
                     "test-coarse", "--prompt", "one two three four five six seven eight nine ten eleven twelve "
                     "thirteen fourteen fifteen sixteen seventeen eighteen", "--max-new-tokens", "4"])
    assert code == 0, capsys.readouterr().err
    assert Coarse.made

    unregister_prefill(Coarse.name)
    with pytest.raises(ValueError, match="^prefill: must be a registered prefill mode .*'test-coarse'"):
        ScissorhandsConfig(budget=budget, prefill="test-coarse")
    assert issubclass(Coarse, Prefill)


def test_a_new_prefill_mode_brings_a_setting_of_its_own(coarse, tmp_path, capsys):
    """``CoarseSettings`` is declared in this file only. Registered with its mode, ``coarse_share`` is a setting
    like the shipped ones: a keyword of the Python API that the layers' prefill reads, a ``--coarse-share`` flag,
    an lm-eval / vLLM ``key=value``, in ``as_dict`` records; valid only with its mode (one line naming it
    otherwise), with its own check; at its default it changes nothing. Its row joins the settings table while it is
    registered; unregistered, it is unknown again."""
    from scissorhands.tools import cli

    assert "| `coarse_share` | `0.5` | test-coarse prefill:" in readme_table()
    model = tiny_model("llama", torch.float64)
    ids, mask = left_padded([40, 29], seed=6)
    budget = 16

    def run(config):
        cache = ScissorhandsCache(model, config)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        return out, cache

    config = ScissorhandsConfig(budget=budget, recent=2, drop=2, prefill="test-coarse", coarse_share=0.25)
    assert config.coarse_share == 0.25 and config.settings.coarse_share == 0.25
    assert config.as_dict()["coarse_share"] == 0.25 and CacheSettings(**config.settings.as_dict()) == config.settings
    mine, cache = run(config)
    shipped, reference = run(ScissorhandsConfig(budget=budget, recent=2, drop=2, prefill="stream", prefill_drop=4))
    assert set(Coarse.made) == {4} and torch.equal(mine, shipped)
    for a, b in zip(cache.budgeted_layers, reference.budgeted_layers):
        assert torch.equal(a.stored_positions(0), b.stored_positions(0))
    # At its default, the same settings as not giving it.
    assert CacheSettings(prefill="test-coarse", coarse_share=0.5) == CacheSettings(prefill="test-coarse")

    # The text forms the lm-eval backend and the vLLM plugin parse, through the same declaration.
    parsed = from_strings(CacheSettings, {"prefill": "test-coarse", "coarse_share": "0.25"})
    assert CacheSettings(**parsed) == CacheSettings(prefill="test-coarse", coarse_share=0.25)
    from scissorhands.vllm.settings import parse as vllm_parse

    # The vLLM adapter's prefill is prompt-aware (its own settings pass); this mode's setting is one line there.
    assert vllm_parse({"budget": 48, "observe": "16"}).config.observe == 16
    with pytest.raises(ValueError, match=r"^coarse_share: a setting of prefill='test-coarse', got "
                       r"prefill='prompt-aware'$"):
        vllm_parse({"budget": 48, "coarse_share": "0.25"})
    for bad, match in ((dict(coarse_share=0.25), r"^coarse_share: a setting of prefill='test-coarse', "
                        r"got prefill='stream'$"),
                       (dict(prefill="test-coarse", coarse_share=2.0), r"^coarse_share: must be in \[0.01, 1.0\)"),
                       (dict(prefill="test-coarse", coarse_share=0.75), r"^coarse_share: 0.75 is refused")):
        with pytest.raises(ValueError, match=match):
            CacheSettings(**bad)
    assert CacheSettings(prefill="test-coarse", coarse_share=0.25).with_plugin("prefill", "stream") == CacheSettings()

    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    Coarse.made.clear()
    prompt = ["--prompt", " ".join(f"word{i}" for i in range(18)), "--max-new-tokens", "4"]
    code = cli.main(["generate", "--model", str(folder), "--budget", "16", "--recent", "2", "--prefill",
                     "test-coarse", "--coarse-share", "0.25", *prompt])
    assert code == 0, capsys.readouterr().err
    assert set(Coarse.made) == {4}
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(folder), "--budget", "16", "--coarse-share", "0.25", *prompt]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: coarse-share: a setting of prefill='test-coarse', got prefill='stream'")

    unregister_prefill(Coarse.name)
    assert "coarse_share" not in OWNED and "coarse_share" not in CacheSettings().as_dict()
    with pytest.raises(TypeError):
        CacheSettings(coarse_share=0.25)
    with pytest.raises(ValueError, match="^coarse_share: unknown"):
        from_strings(CacheSettings, {"coarse_share": "0.25"})
    assert "coarse_share" not in readme_table()


class Counted(StaticDecode):
    """A decode mode of this file's own: the shipped static step, counting the steps it takes."""

    name = "test-counted"
    steps = 0

    def step(self, query, key, value, scaling, softcap):
        type(self).steps += 1
        return super().step(query, key, value, scaling, softcap)


def test_a_new_decode_mode_is_one_class_registered_from_outside():
    """Defined and registered in this file only: ``decode="test-counted"`` gives every layer its step, which takes
    every decode step and keeps what the shipped static step keeps (equal tokens, equal kept positions); an
    unknown name is a one-line error naming ``decode``, as is the mode once unregistered."""
    register_decode(Counted)
    try:
        assert DECODES["test-counted"] is Counted
        model = tiny_model("llama", torch.float32)
        ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(4))
        new = 8

        def run(decode):
            cache = ScissorhandsCache(model, ScissorhandsConfig(budget=16, recent=2, drop=2, decode=decode))
            with torch.no_grad():
                out = model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)
            return out, cache

        Counted.steps = 0
        mine, cache = run("test-counted")
        shipped, reference = run("static")
        assert all(isinstance(layer.kv.static, Counted) for layer in cache.budgeted_layers)
        assert Counted.steps == (new - 1) * len(cache.budgeted_layers)  # every decode step of every layer
        assert torch.equal(mine, shipped)
        for a, b in zip(cache.budgeted_layers, reference.budgeted_layers):
            for row in range(2):
                assert torch.equal(a.stored_positions(row), b.stored_positions(row))
        with pytest.raises(ValueError, match="^decode: must be a registered decode mode .*'no-such-mode'"):
            ScissorhandsConfig(budget=16, decode="no-such-mode")
    finally:
        unregister_decode(Counted.name)
    with pytest.raises(ValueError, match="^decode: must be a registered decode mode .*'test-counted'"):
        ScissorhandsConfig(budget=16, decode="test-counted")


def test_a_prompt_aware_prefill_at_a_budget_below_its_observed_queries_still_selects():
    """Its last ``observe`` (32) queries' own tokens are kept whatever they score only up to a quarter of the
    budget: at 28 tokens a layer every KV head holds the prompt's newest 7 and 21 older ones chosen by their
    scores (kept whole, the 32 would fill the budget and the selection would hold only the prompt's tail:
    HumanEval at 5x passed no problem so). At 128, a quarter covers the 32, which are all kept."""
    from conftest import tiny_model
    from scissorhands import ScissorhandsCache, ScissorhandsConfig

    model = tiny_model("llama")
    t = 200
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    for budget, newest in ((28, 7), (128, 32)):
        cache = ScissorhandsCache(model, ScissorhandsConfig(budget=budget, prefill="prompt-aware"))
        model(ids, cache=cache)
        for layer in cache.budgeted_layers:
            heads = layer.stored_positions(0).tolist()
            for held in heads:
                assert sorted(held)[-newest:] == list(range(t - newest, t))
                assert sum(p < t - newest for p in held) == budget - newest
            assert any(p < t - 32 for held in heads for p in held)  # chosen from before the observed queries


def test_a_method_that_fixes_a_plug_in_drops_the_settings_of_the_one_it_replaces(caplog):
    """A method's own choice of a plug-in wins over the given one (a warning names both), and the settings the
    given plug-in owned go with it, named in a warning, instead of failing as settings of an unchosen plug-in."""
    class Streaming(EvictionMethod):
        name = "test-streaming-prefill"
        settings = {"prefill": "stream"}

    given = CacheSettings(prefill="prompt-aware", observe=4, prompt_chunk=8)
    with caplog.at_level("WARNING", logger="scissorhands.core.methods.base"):
        out = Streaming.resolve(given)
    assert out == CacheSettings(prefill="stream") and out.observe == OWNED["observe"].default
    assert any(r.getMessage().startswith("observe, prompt_chunk: method 'test-streaming-prefill' fixes prefill")
               for r in caplog.records)
    assert Streaming.resolve(out) == out  # applying it twice changes nothing


def test_the_streamed_prefill_owns_prefill_drop():
    """``prefill_drop`` is the streamed prefill's own setting: refused in one line with another mode, taken by a
    mode built on the streamed prefill that declares no settings of its own."""
    assert OWNED["prefill_drop"].axis == "prefill" and "stream" in OWNED["prefill_drop"].owners
    assert CacheSettings(prefill_drop=4).prefill_drop == 4  # the default prefill streams
    with pytest.raises(ValueError, match=r"^prefill_drop: a setting of prefill=.*'stream'.*'prompt-aware'"):
        CacheSettings(prefill="prompt-aware", prefill_drop=4)
    plain = type("PlainStream", (Streamed,), {"name": "test-plain-stream"})
    register_prefill(plain)
    try:
        assert CacheSettings(prefill="test-plain-stream", prefill_drop=4).prefill_drop == 4
    finally:
        unregister_prefill("test-plain-stream")
    assert "test-plain-stream" not in OWNED["prefill_drop"].owners


def test_the_packed_stores_own_their_settings_and_the_settings_imply_the_store():
    """``kv_key_bits``, ``kv_group_size`` and ``kv_tile`` are the packed store's (and the tiered store's, built on
    it), ``kv_demote`` the tiered store's alone. The store is chosen by name or implied (``kv_demote``: tiered;
    ``kv_bits`` below 16: packed), and a packed store needs a width to pack to; a store's setting with another
    store is one line naming it, and every layer's store is built with the value given. The vLLM adapter, which
    keeps K/V in its own blocks, refuses them all."""
    from scissorhands.core.stores import PackedKVStore
    from scissorhands.vllm.settings import parse

    assert {n: (OWNED[n].axis, OWNED[n].owners) for n in ("kv_key_bits", "kv_group_size", "kv_tile", "kv_demote")} \
        == {"kv_key_bits": ("kv_store", {"packed", "tiered"}), "kv_group_size": ("kv_store", {"packed", "tiered"}),
            "kv_tile": ("kv_store", {"packed", "tiered"}), "kv_demote": ("kv_store", {"tiered"})}
    packed = CacheSettings(kv_bits=4, kv_group_size=16, kv_tile=64)
    assert (packed.store(), packed.kv_group_size, packed.kv_tile, packed.kv_key_bits) == ("packed", 16, 64, None)
    assert CacheSettings(kv_bits=2, kv_demote="4:0.5", kv_group_size=8).store() == "tiered"
    assert CacheSettings(kv_bits=16) == CacheSettings()  # 16 bits is the model's dtype: the dense store
    for given, message in [
        (dict(kv_group_size=16), "kv_group_size: a setting of kv_store='packed' or 'tiered', got kv_store=None, "
                                 "which is 'dense' with these settings"),
        (dict(kv_bits=4, kv_store="dense", kv_tile=64), "kv_tile: a setting of kv_store='packed' or 'tiered', "
                                                        "got kv_store='dense'"),
        (dict(kv_bits=4, kv_store="packed", kv_demote="8:0.5"), "kv_demote: a setting of kv_store='tiered', "
                                                                "got kv_store='packed'"),
        (dict(kv_bits=4, kv_group_size=12), "kv_group_size: must be a power of two >= 4, got 12"),
        (dict(kv_store="packed"), "kv_bits: the packed store packs K/V to 8, 4 or 2 bits, got kv_bits=None"),
    ]:
        with pytest.raises(ValueError) as err:
            CacheSettings(**given)
        assert str(err.value) == message
    model = tiny_model("llama")
    cache = ScissorhandsCache(model, ScissorhandsConfig(budget=12, recent=3, kv_bits=4, kv_group_size=8, kv_tile=5))
    stores = [layer.kv.store for layer in cache.budgeted_layers]
    stores = [getattr(s, "inner", s) for s in stores]  # beside its residual
    assert stores and all(isinstance(s, PackedKVStore) and (s.group_size, s.read_tile) == (8, 5) for s in stores)
    for key in ("kv_group_size", "kv_tile", "kv_key_bits"):
        with pytest.raises(ValueError, match=rf"^{key}: not supported by the vLLM adapter \(a setting of "
                                             rf"kv_store='packed' or 'tiered'"):
            parse({"method": "scissorhands", "budget": 16, key: "8"})
