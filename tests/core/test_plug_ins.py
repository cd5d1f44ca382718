"""A new eviction method, or a new K/V store, is one small class: these are defined here, with no framework, and
pass the shipped tests through the transformers cache in tests/hf/test_plug_ins_cache.py (scorer = token-by-token
decoding; batch = each sequence alone); the registries' own rules are checked here.

Nothing in the package changes for them. ``Coarse`` is a new prefill mode, chosen by name
(``prefill``) from the settings, the Python API and the command line. ``HalfStore`` keeps K/V in float16
under a float32 model and is chosen by name (``kv_store``), with and without the full-precision residual
wrapped around it.
``ValueWeighted`` reuses the windowed importance state and weighs it by the value norm; ``PeakAttention``
brings a per-token state of its own (the largest probability each token ever
received), which the layer keeps aligned with K/V through the state hooks.
"""

from dataclasses import dataclass

import pytest
import torch

from scissorhands.core.attend.prefill import PREFILLS, Streamed, register_prefill, unregister_prefill
from scissorhands.core.layer.decode import StaticDecode
from scissorhands.core.methods import EvictionMethod, LayerView, register
from scissorhands.core.settings.config import CacheSettings, ScissorhandsConfig
from scissorhands.core.settings.declare import OWNED, one_of, parse_float, real, setting
from scissorhands.core.stores import DenseKVStore, KVStore, register_store
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.state import TokenState


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


class Counted(StaticDecode):
    """A decode mode of this file's own: the shipped static step, counting the steps it takes."""

    name = "test-counted"
    steps = 0

    def step(self, query, key, value, scaling, softcap):
        type(self).steps += 1
        return super().step(query, key, value, scaling, softcap)


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
