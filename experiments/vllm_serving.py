"""vLLM with and without the scissorhands plugin, in one run: a queue of long requests under a fixed KV space.

Runs in the vLLM environment (``tests/on_vllm/run`` makes ``.venv-vllm``); the model is a safetensors folder
(the converted default: ``python -c "from scissorhands.tools.models import cache_dir; print(cache_dir())"``).

    .venv-vllm/bin/python experiments/vllm_serving.py --model FOLDER --requests 32 --prompt 2048,4096 \\
        --new 128,256 --compression 5 --kv-blocks 200 --out docs/vllm/serving.json

Each variant builds an engine in this process, submits every request at once, and steps until the queue
drains. Per step it records the requests running, the KV blocks held and the time; per request, the time to
its first token. It reports the most requests running at once, total generated tokens/s, the time to drain
the queue, the median and 90th-percentile time to first token, and the KV bytes held, measured (blocks held
x block bytes) against the analytic size (what the plugin's layers store). ``--ample`` instead gives both
variants a KV space that holds every request whole, and reports the decode tokens/s ratio (the per-step
overhead). Prompts are windows of real text (``--text``, default: the opening of Hamlet, repeated).
``--plot RECORD.json`` draws a record's bars as ``RECORD.png`` (in any environment with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

HAMLET = Path(__file__).resolve().parent.parent / "src" / "scissorhands" / "tools" / "data" / "hamlet_act1.txt"


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"vllm_serving: error: {name}: expected N or LO,HI, got {text!r}") from None
    if not 1 <= a <= b:
        raise SystemExit(f"vllm_serving: error: {name}: expected 1 <= LO <= HI, got {text!r}")
    return a, b


def make_requests(tokenizer, text: str, n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int):
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt)
        start = rng.randrange(0, max(1, len(ids)))
        window = (ids[start:] + ids) * (length // max(1, len(ids)) + 2)
        out.append((window[:length], rng.randint(*new)))
    return out


def run_variant(folder: str, requests, plugin: dict | None, kv_blocks: int | None, max_seqs: int,
                max_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(model=folder, dtype="float32", enforce_eager=True, max_model_len=max_len, max_num_seqs=max_seqs,
                seed=0, enable_prefix_caching=False, enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_len, 8192))
    if kv_blocks is not None:
        args["num_gpu_blocks_override"] = kv_blocks
    if plugin is not None:
        args["additional_config"] = {"scissorhands": plugin}
    llm = LLM(**args)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    total_blocks = pool.get_num_free_blocks()
    block_size = core.vllm_config.cache_config.block_size
    start = time.perf_counter()
    arrival = {}
    for i, (ids, new) in enumerate(requests):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        arrival[str(i)] = time.perf_counter()
    first, done, running, held, generated = {}, {}, [], [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        running.append(len(core.scheduler.running))
        held.append(total_blocks - pool.get_num_free_blocks())
        for o in outs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = now - arrival[o.request_id]
            if o.finished:
                done[o.request_id] = now
                generated += len(o.outputs[0].token_ids)
    drain = time.perf_counter() - start
    kv_spec = core.vllm_config.model_config.hf_config
    layers, kv_heads = kv_spec.num_hidden_layers, kv_spec.num_key_value_heads
    head = getattr(kv_spec, "head_dim", None) or kv_spec.hidden_size // kv_spec.num_attention_heads
    block_bytes = layers * 2 * kv_heads * head * block_size * 4  # float32, K and V, every layer
    ttft = sorted(first.values())
    tail = [(h, r) for h, r in zip(held, running) if r][-max(1, len(held) // 4):]  # the last quarter: decoding
    per_request_blocks = statistics.mean(h / r for h, r in tail)
    result = {"requests": len(requests), "max_running": max(running), "drain_s": drain,
              "generated_tokens": generated, "tokens_per_s": generated / drain,
              "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
              "kv_blocks": total_blocks, "block_size": block_size, "peak_blocks_held": max(held),
              "peak_kv_bytes_measured": max(held) * block_bytes,
              "decode_kv_bytes_per_request_measured": per_request_blocks * block_bytes}
    if plugin is not None:
        budget = plugin["budget"]
        # What the plugin's layers hold per running request: the window's blocks, at most
        # ceil((budget - 1) / N) + 1 of them, plus the block being filled.
        per_request = ((budget - 1 + block_size - 1) // block_size + 1) * block_bytes
        result["decode_kv_bytes_per_request_analytic_at_most"] = per_request
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def plot(record_path: str) -> Path:
    """Bars of the two variants side by side (requests at once, tokens/s, KV per decoding request), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(Path(record_path).read_text())
    rows = record["variants"]
    panels = [("max_running", "requests running at once"), ("tokens_per_s", "generated tokens/s"),
              ("decode_kv_bytes_per_request_measured", "KV per decoding request (MB)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.4))
    for ax, (key, title) in zip(axes, panels):
        values = [rows[name][key] / (1e6 if "bytes" in key else 1) for name in ("vllm", "scissorhands")]
        ax.bar(["vLLM", "+ scissorhands"], values, color=["tab:gray", "tab:blue"])
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=9)
    cfg = record["config"]
    fig.suptitle(f"{cfg['requests']} requests, prompts {cfg['prompt']}, new {cfg['new']}, budget {cfg['budget']} "
                 f"({cfg['compression']:g}x)" + ("" if cfg.get("ample") else f", {cfg['kv_blocks']} KV blocks"),
                 fontsize=10)
    fig.tight_layout()
    out = Path(record_path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", metavar="RECORD.json", help="draw an earlier record as a PNG beside it, measure nothing")
    p.add_argument("--model", help="a safetensors model folder")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", default="2048,4096", help="prompt tokens: N or LO,HI (uniform)")
    p.add_argument("--new", default="128,256", help="new tokens per request: N or LO,HI")
    p.add_argument("--compression", type=float, default=5.0, help="budget = mean (prompt + new) / this")
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--kv-blocks", type=int, default=200, help="the fixed KV space, in vLLM blocks of 128 tokens")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--ample", action="store_true", help="KV space for every request whole: the per-step overhead")
    p.add_argument("--text", default=str(HAMLET))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if not args.model:
        p.error("--model is needed to measure")
    from transformers import AutoTokenizer

    prompt, new = _pair(args.prompt, "prompt"), _pair(args.new, "new")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = make_requests(tokenizer, Path(args.text).read_text(), args.requests, prompt, new, args.seed)
    mean_len = statistics.mean(len(ids) + n for ids, n in requests)
    budget = max(2, round(mean_len / args.compression))
    max_len = prompt[1] + new[1] + 8
    kv_blocks = None if args.ample else args.kv_blocks
    plugin = {"budget": budget, "method": args.method}
    rows = {}
    for name, settings in (("vllm", None), ("scissorhands", plugin)):
        rows[name] = run_variant(args.model, requests, settings, kv_blocks, args.max_seqs, max_len)
        print(name, json.dumps(rows[name]), flush=True)
    ratio = {k: rows["scissorhands"][k] / rows["vllm"][k] for k in ("max_running", "tokens_per_s")}
    ratio["drain_s"] = rows["vllm"]["drain_s"] / rows["scissorhands"]["drain_s"]
    record = {"config": vars(args) | {"budget": budget, "mean_length": mean_len}, "variants": rows,
              "ratios": ratio}
    print(json.dumps(ratio))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(plot(args.out) if _has_matplotlib() else "no matplotlib here: draw it with --plot elsewhere")


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


if __name__ == "__main__":
    main()
