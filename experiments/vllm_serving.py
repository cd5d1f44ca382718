"""vLLM with and without the scissorhands plugin, in one run: a queue of long requests under a fixed KV space.

Runs in the vLLM environment (``tests/on_vllm/run`` makes ``.venv-vllm``); the model is a safetensors folder
(the converted default: ``python -c "from scissorhands.tools.model_cache import cache_dir; print(cache_dir())"``).

    .venv-vllm/bin/python experiments/vllm_serving.py --model FOLDER --requests 32 --prompt 2048,4096 \\
        --new 128,256 --compression 5 --kv-blocks 200 --out docs/vllm/serving.json

Each variant builds an engine in this process, submits every request at once, and steps until the queue
drains. Per step it records the requests running, the KV blocks held and the time; per request, the time to
its first token. It reports the most requests running at once, total generated tokens/s, the time to drain
the queue, the median and 90th-percentile time to first token, and the KV bytes held, measured (blocks held
x block bytes) against the analytic size (what the plugin's layers store). ``--ample`` instead gives both
variants a KV space that holds every request whole, and reports the decode tokens/s ratio (the per-step
overhead). Prompts are windows of real text (``--text``, default: the opening of Hamlet, repeated). ``--system N``
makes a chat-like queue: every prompt starts with the same N tokens (a shared system prompt, the text's first N),
then its own window. ``--dtype bfloat16`` serves in bf16 (vLLM's CPU kernel stores it in its "amx" layout on CPUs
with AMX, "vec" elsewhere).
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


def make_requests(tokenizer, text: str, n: int, prompt: tuple[int, int], new: tuple[int, int], seed: int,
                  system: int = 0):
    """``n`` (prompt ids, new tokens): each prompt ``system`` shared tokens (the text's first), then its own window."""
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(seed)
    shared = (ids * (system // max(1, len(ids)) + 1))[:system]
    out = []
    for _ in range(n):
        length = rng.randint(*prompt)
        start = rng.randrange(0, max(1, len(ids)))
        window = (ids[start:] + ids) * (length // max(1, len(ids)) + 2)
        out.append((shared + window[:length], rng.randint(*new)))
    return out


#: The variants a run can alternate. "same flags": both run with chunked prefill and prefix caching off (the plugin
#: holds each prompt whole); "vllm-defaults" is vLLM as it ships (chunked prefill, prefix caching, its compiled mode
#: whatever ``--eager`` says); "vllm-chunked", "vllm-prefix" and "vllm-compiled" are vLLM with the same flags but
#: one of those three turned back on, to tell what each is worth to vLLM alone; "scissorhands-compiled" is the plugin
#: in vLLM's compiled mode, to set beside "vllm-compiled"; "scissorhands-keep-prompt" is the plugin holding each
#: prompt whole (``prefill="keep-prompt"``) with vLLM's prefix caching on, so a shared system prompt is computed
#: and stored once; "scissorhands-shared-prefix" protects the shared system prompt (``protect_prefix``, held where
#: vLLM wrote it and shared through the prefix cache) and evicts the rest of each prompt into a window of the
#: budget after it, with the window's recent tokens and drop at the defaults' shares of that window.
VARIANTS = ("vllm", "scissorhands", "vllm-defaults", "vllm-chunked", "vllm-prefix", "vllm-compiled",
            "scissorhands-compiled", "scissorhands-keep-prompt", "scissorhands-shared-prefix")
SHARES = ("vllm-prefix", "scissorhands-keep-prompt", "scissorhands-shared-prefix")
COMPILED = ("vllm-defaults", "vllm-compiled", "scissorhands-compiled")


def engine_args(name: str, folder: str, kv_blocks: int | None, max_seqs: int, max_len: int, eager: bool,
                block_size: int | None, plugin: dict | None, dtype: str = "float32", system: int = 0) -> dict:
    args = dict(model=folder, dtype=dtype, enforce_eager=eager and name not in COMPILED,
                max_model_len=max_len, max_num_seqs=max_seqs, seed=0)
    if name != "vllm-defaults":
        args.update(enable_prefix_caching=name in SHARES,
                    enable_chunked_prefill=name == "vllm-chunked")
        if name != "vllm-chunked":  # a whole prompt in one step, as the plugin takes it
            args["max_num_batched_tokens"] = max(max_len, 8192)
    if kv_blocks is not None:
        args["num_gpu_blocks_override"] = kv_blocks
    if block_size is not None:
        args["block_size"] = block_size
    if name.startswith("scissorhands"):
        held = {"prefill": "keep-prompt"} if name == "scissorhands-keep-prompt" else {}
        if name == "scissorhands-shared-prefix":
            if not system:
                raise SystemExit("--variants: scissorhands-shared-prefix needs --system N (the prefix it protects)")
            window = plugin["budget"]
            held = {"protect_prefix": system, "budget": system + window, "recent": max(1, round(0.25 * window)),
                    "drop": max(1, round(0.05 * window))}
        args["additional_config"] = {"scissorhands": plugin | held}
    return args


def run_variant(args: dict, requests) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**args)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    total_blocks = pool.get_num_free_blocks()
    block_size = core.vllm_config.cache_config.block_size
    preempted = [0]
    preempt = core.scheduler._preempt_request

    def counting(*a, **k):  # vLLM's recompute preemption: a request's blocks go back, its prompt runs again
        preempted[0] += 1
        return preempt(*a, **k)

    core.scheduler._preempt_request = counting
    start = time.perf_counter()
    arrival = {}
    for i, (ids, new) in enumerate(requests):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        arrival[str(i)] = time.perf_counter()
    first, done, running, held, generated, cached = {}, {}, [], [], 0, 0
    count: dict[str, int] = {}
    decode_tokens, decode_time = 0, 0.0
    before = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        running.append(len(core.scheduler.running))
        held.append(total_blocks - pool.get_num_free_blocks())
        made, prefilled = 0, False
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if n and o.request_id not in first:
                first[o.request_id] = now - arrival[o.request_id]
                prefilled = True
            made += max(0, n - count.get(o.request_id, 0))
            count[o.request_id] = n
            if o.finished:
                done[o.request_id] = now
                generated += n
                cached += o.num_cached_tokens or 0  # prompt tokens vLLM's prefix cache gave
        if made and not prefilled:  # a step of decode tokens only: no prompt was attended in it
            decode_tokens += made
            decode_time += now - before
        before = now
    drain = time.perf_counter() - start
    kv_spec = core.vllm_config.model_config.hf_config
    layers, kv_heads = kv_spec.num_hidden_layers, kv_spec.num_key_value_heads
    head = getattr(kv_spec, "head_dim", None) or kv_spec.hidden_size // kv_spec.num_attention_heads
    element = 2 if args.get("dtype") in ("bfloat16", "float16") else 4
    block_bytes = layers * 2 * kv_heads * head * block_size * element  # K and V, every layer
    ttft = sorted(first.values())
    tpot = sorted((done[r] - arrival[r] - first[r]) / max(1, count[r] - 1) for r in done)
    tail = [(h, r) for h, r in zip(held, running) if r][-max(1, len(held) // 4):]  # the last quarter: decoding
    per_request_blocks = statistics.mean(h / r for h, r in tail)
    result = {"requests": len(requests), "max_running": max(running), "drain_s": drain,
              "mean_running": statistics.mean(running), "median_running": statistics.median(running),
              "generated_tokens": generated, "tokens_per_s": generated / drain,
              "decode_tokens_per_s": decode_tokens / decode_time if decode_time else None,
              "tpot_median_s": statistics.median(tpot),
              "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
              "kv_blocks": total_blocks, "block_size": block_size, "peak_blocks_held": max(held),
              "peak_kv_bytes_measured": max(held) * block_bytes,
              "decode_kv_bytes_per_request_measured": per_request_blocks * block_bytes,
              "preemptions": preempted[0], "prefix_cached_tokens": cached,
              "prompt_tokens": sum(len(ids) for ids, _ in requests),
              "enforce_eager": args["enforce_eager"], "chunked_prefill": args.get("enable_chunked_prefill", True),
              "prefix_caching": args.get("enable_prefix_caching", True)}
    plugin = args.get("additional_config", {}).get("scissorhands")
    if plugin is not None:
        budget = plugin["budget"]
        # What the plugin's layers hold per running request: the window's blocks, at most
        # ceil((budget - 1) / N) + 1 of them, plus the block being filled.
        per_request = ((budget - 1 + block_size - 1) // block_size + 1) * block_bytes
        result["decode_kv_bytes_per_request_analytic_at_most"] = per_request
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def portable(path):
    """A path as a record keeps it: relative to the project where it lies inside it, else from the home folder
    (``~``), so that a record says the same on every machine; anything else as given."""
    if not isinstance(path, str) or not path:
        return path
    full = Path(path).expanduser().resolve()
    for base, shown in ((HAMLET.parents[4], ""), (Path.home(), "~/")):
        if full.is_relative_to(base):
            return shown + str(full.relative_to(base))
    return path


def _load() -> float:
    return os.getloadavg()[0]


def plot(record_path: str) -> Path:
    """Bars per variant (medians over rounds, whiskers from the lowest to the highest round), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(Path(record_path).read_text())
    runs = record.get("runs") or {name: [row] for name, row in record["variants"].items()}  # older records
    names = list(runs)
    panels = [("mean_running", "requests running (mean over steps)", 1), ("max_running", "most running at once", 1),
              ("tokens_per_s", "generated tokens/s", 1),
              ("decode_tokens_per_s", "decode-only tokens/s", 1), ("tpot_median_s", "time per output token (ms)", 1e-3),
              ("decode_kv_bytes_per_request_measured", "KV per decoding request (MB)", 1e6)]
    panels = [x for x in panels if any(r.get(x[0]) is not None for rows in runs.values() for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.1 * len(panels), 3.4))
    colors = {"vllm": "tab:gray", "scissorhands": "tab:blue", "vllm-defaults": "tab:olive", "vllm-chunked": "tab:cyan",
              "scissorhands-compiled": "tab:red", "scissorhands-keep-prompt": "tab:green",
              "scissorhands-shared-prefix": "tab:purple",
              "vllm-prefix": "tab:purple", "vllm-compiled": "tab:brown"}
    for ax, (key, title, unit) in zip(axes, panels):
        mids, lo, hi = [], [], []
        for name in names:
            vals = [r[key] / unit for r in runs[name] if r.get(key) is not None] or [0.0]
            mid = statistics.median(vals)
            mids.append(mid)
            lo.append(mid - min(vals))
            hi.append(max(vals) - mid)
        ax.bar(range(len(names)), mids, yerr=[lo, hi], capsize=3, color=[colors.get(n, "tab:red") for n in names])
        ax.set_xticks(range(len(names)), [n.replace("scissorhands", "+ scissorhands") for n in names], fontsize=8,
                      rotation=15)
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(mids):
            ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8)
    cfg = record["config"]
    fig.suptitle(f"{cfg['requests']} requests, prompts {cfg['prompt']}, new {cfg['new']}, budget {cfg['budget']} "
                 f"({cfg['compression']:g}x)" + (", ample KV" if cfg.get("ample") else f", {cfg['kv_blocks']} KV "
                 f"blocks") + f", {cfg.get('rounds', 1)} round(s)", fontsize=10)
    fig.tight_layout()
    out = Path(record_path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per variant the median of each figure over rounds; per other variant against "scissorhands", the median,
    min and max of the per-round ratios (round i of one against round i of the other)."""
    keys = ("tokens_per_s", "decode_tokens_per_s", "tpot_median_s", "ttft_median_s", "max_running", "mean_running",
            "peak_blocks_held", "decode_kv_bytes_per_request_measured", "preemptions", "drain_s")
    medians = {name: {k: statistics.median(r[k] for r in rows if r.get(k) is not None)
                      for k in keys if any(r.get(k) is not None for r in rows)} for name, rows in runs.items()}
    ratios = {}
    for ours in [name for name in runs if name.startswith("scissorhands")]:
        mine = runs[ours]
        for name, rows in runs.items():
            if name.startswith("scissorhands"):
                continue
            for k in ("tokens_per_s", "decode_tokens_per_s", "max_running", "mean_running"):
                each = [a[k] / b[k] for a, b in zip(mine, rows) if a.get(k) and b.get(k)]
                if each:  # "scissorhands" keeps the key it always had
                    key = f"{k} vs {name}" if ours == "scissorhands" else f"{k} of {ours} vs {name}"
                    ratios[key] = {"median": statistics.median(each), "min": min(each), "max": max(each),
                                   "n": len(each)}
    return {"medians": medians, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", metavar="RECORD.json", help="draw an earlier record as a PNG beside it, measure nothing")
    p.add_argument("--model", help="a safetensors model folder")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt", default="2048,4096", help="prompt tokens: N or LO,HI (uniform)")
    p.add_argument("--new", default="128,256", help="new tokens per request: N or LO,HI")
    p.add_argument("--compression", type=float, default=5.0, help="budget = mean (prompt + new) / this")
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--drop", default=None, help="the plugin's drop amount (a fraction of the budget, or a count); "
                   "default: the library's")
    p.add_argument("--kv-blocks", type=int, default=200, help="the fixed KV space, in vLLM blocks")
    p.add_argument("--block-size", type=int, default=None, help="vLLM's block size (default: vLLM's own)")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--ample", action="store_true", help="KV space for every request whole: the per-step overhead")
    p.add_argument("--variants", default="vllm,scissorhands", help=f"comma-separated, alternated: {VARIANTS}")
    p.add_argument("--rounds", type=int, default=1, help="each variant this many times, alternated A/B/B/A (each "
                   "round after the first in the order opposite to the one before, so no variant always runs first)")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="enforce_eager for every variant (--no-eager: vLLM's default compiled mode)")
    p.add_argument("--text", default=str(HAMLET))
    p.add_argument("--system", type=int, default=0, help="a shared system prompt of this many tokens before each "
                   "prompt (a chat-like queue)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype in vLLM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.plot:
        print(plot(args.plot))
        return
    if not args.model:
        p.error("--model is needed to measure")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.rounds < 1:
        p.error(f"--rounds: must be >= 1, got {args.rounds}")
    from transformers import AutoTokenizer

    prompt, new = _pair(args.prompt, "prompt"), _pair(args.new, "new")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = make_requests(tokenizer, Path(args.text).read_text(), args.requests, prompt, new, args.seed,
                             args.system)
    mean_len = statistics.mean(len(ids) + n for ids, n in requests)
    budget = max(2, round(mean_len / args.compression))
    max_len = args.system + prompt[1] + new[1] + 8
    kv_blocks = None if args.ample else args.kv_blocks
    plugin: dict = {"budget": budget, "method": args.method}
    if args.drop is not None:
        plugin["drop"] = float(args.drop) if "." in args.drop else int(args.drop)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for place, name in enumerate(variants if r % 2 == 0 else variants[::-1]):
            eargs = engine_args(name, args.model, kv_blocks, args.max_seqs, max_len, args.eager, args.block_size,
                                plugin, args.dtype, args.system)
            load = _load()
            row = run_variant(eargs, requests) | {"round": r, "place": place, "load_before": load}
            runs[name].append(row)
            print(name, json.dumps(row), flush=True)
    summary = summarize(runs)
    given = {k: portable(v) if k in ("model", "text", "out") else v for k, v in vars(args).items()}
    record = {"config": given | {"budget": budget, "mean_length": mean_len, "plugin": plugin}, "runs": runs,
              "variants": {k: v for k, v in summary["medians"].items()}, "ratios": summary["ratios"]}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(plot(args.out) if _has_matplotlib() else "no matplotlib here: draw it with --plot elsewhere")


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


if __name__ == "__main__":
    main()
