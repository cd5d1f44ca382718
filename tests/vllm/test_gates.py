"""The plugin's start-up gates as functions of plain values (``scissorhands.vllm.plugin.refuse_*``), without vLLM.

Each refuses in one line that starts with the name of what is refused, and lets through what the plugin serves;
``tests/on_vllm/test_startup_gates.py`` reaches each through a real engine.
"""

import pytest

from scissorhands.vllm.plugin import refuse_groups, refuse_layer, refuse_layout, refuse_platform
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
