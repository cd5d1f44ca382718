"""The plugin's start-up gates as functions of plain values (``scissorhands.vllm.plugin.refuse_*``), without vLLM.

Each refuses in one line that starts with the name of what is refused, and lets through what the plugin serves;
``tests/on_vllm/test_startup_gates.py`` reaches each through a real engine. The predictions from a model's config
(``declared_kind``, ``stand_in_windows``) are given plain objects with transformers' attribute names.
"""

from types import SimpleNamespace

import pytest

from scissorhands.vllm.plugin import (
    declared_kind,
    refuse_groups,
    refuse_layer,
    refuse_layout,
    refuse_platform,
    refuse_state,
    stand_in_windows,
)
from scissorhands.vllm.settings import Refusal

LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}  # what kernels.LAYOUTS holds


def _line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu", "xpu", "out-of-tree"])
def test_every_platform_but_the_cpu_is_refused_by_name(platform):
    with pytest.raises(Refusal) as err:
        refuse_platform(platform, is_cpu=False)
    assert _line(err).startswith("scissorhands: ") and repr(platform) in str(err.value)


def test_the_cpu_platform_passes():
    refuse_platform("cpu", is_cpu=True)


@pytest.mark.parametrize("layout", ["neon", "rvv", "vxe", "vsx", "something-new"])
def test_a_layout_the_operator_cannot_read_is_refused_by_name(layout):
    with pytest.raises(Refusal) as err:
        refuse_layout(layout, LAYOUTS)
    message = _line(err)
    assert message.startswith("scissorhands: ") and repr(layout) in message and "vec, vec16, amx" in message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layouts_the_operator_reads_pass(layout):
    refuse_layout(layout, LAYOUTS)


def test_a_layer_of_another_kind_is_refused_naming_it_and_a_plain_one_passes():
    refuse_layer("model.layers.0.self_attn.attn", None)
    with pytest.raises(Refusal) as err:
        refuse_layer("model.layers.3.self_attn.attn", "chunked local attention (chunks of 8192 tokens)")
    assert _line(err).startswith("model: layer model.layers.3.self_attn.attn is chunked local attention")


def test_budgeted_layers_in_one_group_pass_and_in_several_are_refused():
    refuse_groups([])
    refuse_groups([[f"model.layers.{i}.self_attn.attn" for i in range(30)]])
    with pytest.raises(Refusal) as err:
        refuse_groups([["a.1", "a.3", "a.5"], ["a.2", "a.4"]])
    message = _line(err)
    assert message.startswith("model: vLLM splits this model's budgeted layers into 2 KV-cache groups")
    assert "(a.1, a.3, ...; a.2, a.4)" in message


@pytest.mark.parametrize("config, start", [
    (dict(is_causal=False), "encoder-only attention (is_causal: false"),
    (dict(is_encoder_decoder=True), "an encoder-decoder model"),
    (dict(attention_chunk_size=8192), "chunked local attention (attention_chunk_size: 8192"),
    (dict(num_kv_shared_layers=10), "KV sharing (num_kv_shared_layers: 10"),
], ids=["encoder_only", "encoder_decoder", "chunked_local", "kv_sharing"])
def test_a_config_that_declares_another_kind_of_attention_is_named(config, start):
    kind = declared_kind(SimpleNamespace(**config))
    assert kind is not None and kind.startswith(start) and "\n" not in kind
    assert declared_kind(SimpleNamespace(), SimpleNamespace(**config)) == kind  # found in the text config too


@pytest.mark.parametrize("attn_type", ["encoder_only", "encoder_decoder"])
def test_vllms_attention_type_names_models_that_declare_nothing(attn_type):
    assert declared_kind(SimpleNamespace(), attn_type=attn_type) is not None


def test_a_plain_decoder_config_declares_nothing():
    plain = SimpleNamespace(is_causal=True, is_encoder_decoder=False, attention_chunk_size=None,
                            num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"])
    assert declared_kind(plain, SimpleNamespace(), attn_type="decoder") is None


def test_stand_in_windows_are_the_budget_for_full_layers_and_their_own_for_sliding_ones():
    kinds = ["sliding_attention", "full_attention", "attention", "sliding_attention"]
    assert stand_in_windows(kinds, 16, 64) == [16, 64, 64, 16]
    assert stand_in_windows(["full_attention"] * 3, None, 64) == [64, 64, 64]


@pytest.mark.parametrize("kinds, window", [
    (None, 16), ([], 16),
    (["sliding_attention", "full_attention"], None),  # a sliding layer with no window given
    (["linear_attention", "full_attention"], 16),  # a cache spec that is not a window
    (["chunked_attention", "full_attention"], 16),
])
def test_no_stand_ins_where_the_config_does_not_say_every_layers_window(kinds, window):
    assert stand_in_windows(kinds, window, 64) is None


def test_per_slot_state_that_would_not_fit_beside_the_cache_is_refused_in_one_line():
    """An exact 400-step window keeps 1,604 bytes per slot and KV head beside a K/V of a few hundred: over a whole
    KV cache that can be more than the machine has. Refused (naming ``window``) when it passes half of what is
    free; the defaults' one bucket, or memory that cannot be read, pass."""
    slots, heads, layers = 150_000, 2, 24
    need = slots * heads * layers * (4 + 4 * 400)  # 11.5 GB
    refuse_state(slots, heads, layers, 400, need * 2)
    refuse_state(slots, heads, layers, 1, 10 * 2 ** 30)
    refuse_state(slots, heads, layers, 400, None)
    refuse_state(slots, heads, layers, 0, 2 ** 20 * 80)  # a method without importance: positions only, 29 MB
    with pytest.raises(Refusal, match=r"^kv_cache: .* more than half the 0\.0 GiB free beside it; give vLLM a "
                                      r"smaller KV cache"):
        refuse_state(slots, heads, layers, 1, -2 ** 30)  # a cache larger than what is free: nothing beside it
    with pytest.raises(Refusal) as err:
        refuse_state(slots, heads, layers, 400, 2 * need - 1)
    message = _line(err)
    assert message.startswith("window: the plugin's per-slot state, a position and 400 float32 importance "
                              "bucket(s) per slot and KV head, takes 10.8 GiB for this engine's 150,000-slot KV "
                              "cache over 24 layers, more than half the 21.5 GiB free beside it; set "), message


_SERVER = '''
import multiprocessing, sys
from scissorhands.vllm.refusals import await_refusals, refuse_in_engine
from scissorhands.vllm.settings import Refusal

def engine(refuse):
    if refuse:
        refuse_in_engine(Refusal("model: layer 0 is prefix-LM attention"))

if __name__ == "__main__":
    await_refusals()  # the front end, as a server's engine config is made
    if sys.argv[1] == "refuse_here":  # an engine in the front end's own process
        engine(True)
    process = multiprocessing.get_context("fork").Process(target=engine, args=(sys.argv[1] == "refuse",))
    process.start()
    process.join()
    print(process.exitcode, flush=True)
    raise RuntimeError("Engine core initialization failed. See root cause above.")
'''


@pytest.mark.parametrize("refuse", ["refuse", "refuse_here", None],
                         ids=["refused_in_the_engine", "refused_in_the_front_ends_engine", "another_failure"])
def test_a_refusal_left_by_an_engine_process_is_the_servers_one_line_and_exit_code_2(tmp_path, refuse):
    """The front end names a file for its engine processes (inherited through the environment); an engine process
    that refuses leaves its line there and ends with code 2 and no traceback; the front end's failed start then
    prints that line, last, and exits with code 2, its file removed. Any other failure keeps Python's traceback
    and exit code 1. An engine in the front end's own process raises its refusal, which the server says the same
    way, and leaves no file."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    env = {k: v for k, v in os.environ.items() if k != "SCISSORHANDS_VLLM_REFUSAL"}
    proc = subprocess.Popen([sys.executable, str(script), refuse or "serve"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = proc.communicate(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    lines = done.stderr.strip().splitlines()
    if refuse:
        assert (done.returncode, done.stdout.split()) == (2, ["2"] if refuse == "refuse" else []), done.stderr
        assert lines[-1] == "scissorhands: error: model: layer 0 is prefix-LM attention", done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    else:
        assert (done.returncode, done.stdout.split()) == (1, ["0"]), done.stderr
        assert "Traceback" in done.stderr and lines[-1].startswith("RuntimeError: Engine core"), done.stderr
    assert not list(Path(tempfile.gettempdir()).glob(f"scissorhands-refusal-{proc.pid}-*"))  # its file removed
