"""A prefill mode defined in tests/core/test_plug_ins.py (``Coarse``) from the Python API and the command line,
and the setting it brings as a flag and an lm-eval / vLLM key."""

import pytest
import torch
from test_plug_ins import Coarse

from conftest import left_padded, tiny_model
from scissorhands import ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.attend.prefill import PREFILLS, Prefill, register_prefill, unregister_prefill
from scissorhands.core.settings.config import CacheSettings, readme_table
from scissorhands.core.settings.declare import OWNED, from_strings


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
