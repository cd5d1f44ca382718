"""vLLM's CPU build with the scissorhands plugin, in its own environment (``tests/on_vllm/run`` makes it).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: seconds to start, and the layers'
state can be read), on a tiny random Llama saved from a config. The transformers side of each comparison
runs in the project's environment (``SCISSORHANDS_REFERENCE_PYTHON``), since vLLM pins an older
transformers than the project's.
"""

import gc
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from workers import share_cores

share_cores()  # under xdist, each worker its share of the cores and its own cores for vLLM (tests/workers.py)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["HF_HUB_OFFLINE"] = "1"

HERE = Path(__file__).resolve().parent
BLOCK = 32


def pytest_sessionstart(session) -> None:
    """Say which K/V layout vLLM's CPU kernel takes on this machine, for the bf16 test ("amx" with AMX, else
    "vec"), at the top of the report (also under ``-q``)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa as isa

    line = (f"vLLM CPU K/V layout on this machine: float32 {isa(torch.float32, BLOCK, 32)} | bf16 "
            f"{isa(torch.bfloat16, BLOCK, 32)}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


def reference_python() -> str:
    exe = os.environ.get("SCISSORHANDS_REFERENCE_PYTHON")
    if not exe:
        raise RuntimeError("SCISSORHANDS_REFERENCE_PYTHON: set it to the project environment's python "
                           "(tests/on_vllm/run does); the transformers side of the comparisons runs there")
    return exe


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(folder)
    return str(folder)


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


class Engine:
    """One in-process vLLM engine; ``plugin`` is the scissorhands settings object (None: the plugin is off)."""

    def __init__(self, folder: str, plugin: dict | None = None, **overrides):
        from vllm import LLM

        # 256 blocks of 32 hold 8 requests of 512 tokens twice over; vLLM would otherwise fill its 1 GiB with tens of
        # thousands of blocks, and the plugin's per-slot state (400 buckets for the paper preset) beside them.
        args = dict(model=folder, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8, seed=0,
                    block_size=BLOCK, skip_tokenizer_init=True, enable_prefix_caching=False,
                    num_gpu_blocks_override=256)
        args.update(overrides)
        if plugin is not None:
            args["additional_config"] = {"scissorhands": plugin}
        self.llm = LLM(**args)

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core  # in-process: the EngineCore itself

    def free_blocks(self) -> int:
        return self.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def generate(self, token_prompts: list[list[int]], new_tokens: int, spans: list | None = None) -> list[dict]:
        """Greedy answers; ``spans``: each prompt's own protected spans (``extra_args``), or None for none."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0,
                                 extra_args=None if not s else {"scissorhands_protect": s})
                  for s in (spans or [None] * len(token_prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], params, use_tqdm=False)
        return [{"request_id": o.request_id, "tokens": list(o.outputs[0].token_ids),
                 "logprobs": [next(iter(d.values())).logprob for d in o.outputs[0].logprobs],
                 "cached": o.num_cached_tokens} for o in outs]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def plugin_state(llm):
    """The plugin's state in an in-process engine's worker (``scissorhands.vllm.worker.EngineState``)."""
    state = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.scissorhands
    assert state is not None, "the engine runs without the plugin"
    return state


def kept_now(engine: Engine) -> dict[str, list]:
    """Per live request: per budgeted layer, the positions each KV head stores (sorted)."""
    state = plugin_state(engine.llm)
    out: dict[str, list] = {}
    planner = state.planner
    for layer in state.layers:
        for rid, (table_row, seen) in planner.where.items():
            # The engine's own request ids are the caller's with a suffix ("0-ae8a9492").
            held = planner.held.get(rid, 0)  # a held prompt (keep-prompt) beside the window
            out.setdefault(rid.rsplit("-", 1)[0], []).append(layer.stored_positions(table_row, seen, held).tolist())
    return out


def reference(folder: str, plugin: dict, token_prompts: list[list[int]], generated: list[list[int]],
              tmp_path: Path, spans: list | None = None) -> list[dict]:
    """The transformers ScissorhandsCache on the same prompts and tokens (see reference.py); ``spans``: each
    prompt's own protected spans, beside the protected prefix."""
    request, answer = tmp_path / "request.json", tmp_path / "answer.json"
    request.write_text(json.dumps({"folder": folder, "plugin": plugin, "prompts": token_prompts,
                                   "tokens": generated, "spans": spans or [[] for _ in token_prompts]}))
    server = _reference_server()
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps([str(request), str(answer)]) + "\n")
    server.stdin.flush()
    reply = "?"
    while reply and reply not in ("ok\n",) and not reply.startswith("error: "):  # other output is not a reply
        reply = server.stdout.readline()
    assert reply == "ok\n", reply or "the reference process ended (its stderr is above)"
    return json.loads(answer.read_text())


_REFERENCE: list[subprocess.Popen] = []  # one serving process per session, started on first use


def _reference_server() -> subprocess.Popen:
    if not _REFERENCE or _REFERENCE[0].poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
        _REFERENCE[:] = [subprocess.Popen([reference_python(), str(HERE / "reference.py"), "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)]
    return _REFERENCE[0]


def pytest_sessionfinish(session, exitstatus):
    for server in _REFERENCE:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
