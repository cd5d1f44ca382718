"""NVIDIA kvpress's decode-time compression (``DecodingPress``) beside ours: same model, text, prompt and budget.

kvpress 0.5.5 pins transformers < 5.3, so its side runs in its own virtual
environment; ours runs in the project's. The same script drives both and
writes the same JSON records (``--engine``), which ``--merge`` joins:

    python -m venv kvpress-venv && kvpress-venv/bin/pip install kvpress==0.5.5 torch==2.13.0
    kvpress-venv/bin/python experiments/kvpress_side_by_side.py --engine kvpress --out kvpress.json
    python experiments/kvpress_side_by_side.py --engine scissorhands --out ours.json
    python experiments/kvpress_side_by_side.py --merge kvpress.json ours.json --out docs/bench/kvpress_side_by_side.json

Both sides load SmolLM2-135M-Instruct from the safetensors folder the project
converts the embedded GGUF into (``scissorhands.tools.models.load_model`` writes it
under ``~/.cache/scissorhands/`` or ``$SCISSORHANDS_CACHE``), so they run the
very same float weights.

What is measured, per method, at one budget:

* **perplexity, teacher-forced by token-by-token decoding**: a short prompt
  (shorter than the budget) is prefilled, then every following token of the
  text is fed one at a time and the model's log-probability of the next one
  is recorded; the cache compresses as it would while generating;
* **decode tokens/s**: the median step time of that same loop;
* **bytes held**: K/V bytes of the cache at the end, from tensor storage, and
  the largest seen at any step (``DecodingPress`` lets the cache grow by its
  ``compression_interval`` between compressions).

A press that fails on this model or transformers version is recorded with its
error, not left out.

``--kv-bits B`` runs the same with B-bit K/V on both sides: kvpress's presses
on top of transformers' ``QuantizedCache`` (the optimum-quanto backend, which
kvpress documents for quantised caches: groups of 64, a 128-token residual
re-quantised when full), and ours with ``kv_bits=B`` (its default 32-token
residual); bytes are counted from the quantised tensors' own storage.

``--speed-context T`` measures decode speed where attention matters instead:
a ``T``-token prompt (the text, repeated) at batch ``--speed-batch`` is
prefilled once per engine, then each cache decodes ``--speed-steps`` greedy
tokens; the median step after ``--speed-warmup`` steps is reported, with the
K/V bytes held. The budget is ``--budget`` tokens per layer. kvpress's presses
share one full-cache prefill (a copy each): ``DecodingPress`` only compresses
while decoding, so its first compressions fall in the warm-up. Ours prefills
through its own cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "src" / "scissorhands" / "data" / "hamlet_act1.txt"


def model_folder() -> Path:
    base = Path(os.environ.get("SCISSORHANDS_CACHE", Path.home() / ".cache" / "scissorhands"))
    folder = base / "smollm2-135m-instruct"
    if not (folder / "model.safetensors").exists():
        raise SystemExit(f"model: no converted SmolLM2 under {base}; run `scissorhands demo` once in the project's "
                         "environment to create it")
    return folder


def load(attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn)
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def kv_bytes(cache) -> int:
    """K/V bytes of a transformers cache, whichever layout its version uses (quantised layers included)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        names = ("keys", "values", "_quantized_keys", "_quantized_values")
        return sum(_storage_bytes(getattr(x, n, None)) for x in layers for n in names)
    return sum(k.nbytes + v.nbytes for k, v in zip(cache.key_cache, cache.value_cache))


def _storage_bytes(t) -> int:
    """Bytes a tensor holds; a tensor subclass (a quanto QTensor) is the sum of its inner tensors."""
    if t is None:
        return 0
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_storage_bytes(getattr(t, n)) for n in names)
    return t.nbytes


def teacher_forced(model, ids: torch.Tensor, prompt: int, cache, context=None, memory=None) -> dict:
    """Prefill ``ids[:, :prompt]``, then feed the rest token by token; NLL of each next token, step times, bytes."""
    nll, times, peak = [], [], 0
    with torch.no_grad(), (context if context is not None else _null()):
        out = model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1]
        for t in range(prompt, ids.shape[1]):
            nll.append(-torch.log_softmax(logits.float(), dim=-1)[0, ids[0, t]].item())
            if t == ids.shape[1] - 1:
                break
            start = time.perf_counter()
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            logits = out.logits[:, -1]
            held = memory(cache) if memory is not None else kv_bytes(cache)
            peak = max(peak, held)
    held = memory(cache) if memory is not None else kv_bytes(cache)
    step = statistics.median(times[len(times) // 10:])  # the first tenth is the warm-up
    mean = sum(nll) / len(nll)
    return {"tokens_scored": len(nll), "nll": mean, "ppl": math.exp(mean), "step_s": step,
            "tokens_per_s": 1 / step, "kv_bytes_end": held, "kv_bytes_peak": peak}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_kvpress(args, ids) -> list[dict]:
    import kvpress
    from transformers import DynamicCache

    def fresh(model):
        if args.kv_bits is None:
            return DynamicCache()
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=args.kv_bits)

    full_name = "full (DynamicCache)" if args.kv_bits is None else f"full (QuantizedCache, quanto {args.kv_bits}-bit)"
    scorers = {"streaming_llm": lambda: kvpress.StreamingLLMPress(),
               "tova": lambda: kvpress.TOVAPress(),
               "observed_attention": lambda: kvpress.ObservedAttentionPress(),
               "knorm": lambda: kvpress.KnormPress()}
    rows = []
    for name, make in scorers.items():
        attn = "eager" if name == "observed_attention" else "sdpa"  # it reads the attention weights
        model, _ = load(attn)
        press = kvpress.DecodingPress(base_press=make(), compression_interval=args.steps_between,
                                      target_size=args.budget)
        row = {"engine": "kvpress", "version": getattr(kvpress, "__version__", "0.5.5"),
               "method": f"DecodingPress({name})", "budget": args.budget, "compression_interval": args.steps_between,
               "attn": attn, "kv_bits": args.kv_bits}
        try:
            row.update(teacher_forced(model, ids, args.prompt, fresh(model), press(model)))
        except Exception as e:  # a press that fails here is a result, recorded with its error
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
    model, _ = load()
    rows.append({"engine": "kvpress", "method": full_name, "budget": None, "kv_bits": args.kv_bits,
                 **teacher_forced(model, ids, args.prompt, fresh(model))})
    return rows


def run_ours(args, ids) -> list[dict]:
    from scissorhands import CacheSettings, ScissorhandsCache
    from scissorhands.core.methods import get_method

    model, _ = load()
    rows = []
    settings = CacheSettings(kv_bits=args.kv_bits)
    names = ("scissorhands", "tova", "streaming", "h2o") + (() if args.kv_bits is None else ("full",))
    for name in names:
        method = get_method(name)
        # The full method quantises without evicting: a cache as large as the text.
        config = method.configure(settings, args.tokens if method.is_full else args.budget)
        cache = ScissorhandsCache(model, config, method())
        row = {"engine": "scissorhands", "method": name, "budget": None if method.is_full else args.budget,
               "kv_bits": args.kv_bits}
        row.update(teacher_forced(model, ids, args.prompt, cache,
                                  memory=lambda c: c.memory_report()["model_kv_bytes"]))
        row["importance_bytes"] = cache.memory_report()["importance_bytes"]
        rows.append(row)
    return rows


def _prompt(tok, context: int, batch: int) -> torch.Tensor:
    ids = tok(TEXT.read_text())["input_ids"]
    reps = -(-context // len(ids))
    return torch.tensor([(ids * reps)[:context]] * batch)


def _decode_speed(model, cache, nxt, steps: int, warmup: int, memory, context=None) -> dict:
    times, peak = [], 0
    with torch.no_grad(), (context if context is not None else _null()):
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            peak = max(peak, memory(cache))
    step = statistics.median(times[warmup:])
    return {"step_s": step, "step_s_all": times, "tokens_per_s": nxt.shape[0] / step,
            "kv_bytes_end": memory(cache), "kv_bytes_peak_decode": peak}


def speed_kvpress(args) -> list[dict]:
    import copy

    import kvpress
    from transformers import DynamicCache

    model, tok = load()
    ids = _prompt(tok, args.speed_context, args.speed_batch)
    cache = DynamicCache()
    start = time.perf_counter()
    with torch.no_grad():
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    prefill_s = time.perf_counter() - start
    rows = []
    presses = {"full (DynamicCache)": None, "DecodingPress(tova)": kvpress.TOVAPress,
               "DecodingPress(streaming_llm)": kvpress.StreamingLLMPress, "DecodingPress(knorm)": kvpress.KnormPress}
    for name, make in presses.items():
        row = {"engine": "kvpress", "method": name, "budget": None if make is None else args.budget,
               "context": args.speed_context, "batch": args.speed_batch, "prefill_s": prefill_s}
        try:
            ctx = None if make is None else kvpress.DecodingPress(
                base_press=make(), compression_interval=args.steps_between, target_size=args.budget)(model)
            row.update(_decode_speed(model, copy.deepcopy(cache), nxt, args.speed_steps, args.speed_warmup,
                                     kv_bytes, ctx))
        except Exception as e:  # a press that fails here is a result, recorded with its error
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        rows.append(row)
    return rows


def speed_ours(args) -> list[dict]:
    from scissorhands import CacheSettings, ScissorhandsCache
    from scissorhands.core.methods import get_method

    model, tok = load()
    ids = _prompt(tok, args.speed_context, args.speed_batch)
    method = get_method("scissorhands")
    cache = ScissorhandsCache(model, method.configure(CacheSettings(), args.budget), method())
    start = time.perf_counter()
    with torch.no_grad():
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    row = {"engine": "scissorhands", "method": "scissorhands", "budget": args.budget, "context": args.speed_context,
           "batch": args.speed_batch, "prefill_s": time.perf_counter() - start}
    row.update(_decode_speed(model, cache, nxt, args.speed_steps, args.speed_warmup,
                             lambda c: c.memory_report()["model_kv_bytes"]))
    row["importance_bytes"] = cache.memory_report()["importance_bytes"]
    return [row]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=("kvpress", "scissorhands"))
    p.add_argument("--merge", nargs="+", default=None, help="join JSON files written by both engines")
    p.add_argument("--budget", type=int, default=128, help="tokens kept per layer")
    p.add_argument("--steps-between", type=int, default=8,
                   help="DecodingPress compression_interval (ours drops 5%% of the budget at a time)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens prefilled before token-by-token scoring")
    p.add_argument("--tokens", type=int, default=1024, help="text tokens in all (prompt included)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-bits", type=int, default=None, choices=(2, 4, 8),
                   help="quantised K/V on both sides (kvpress: QuantizedCache with optimum-quanto)")
    p.add_argument("--speed-context", type=int, default=None, help="measure decode speed after a prompt this long")
    p.add_argument("--speed-batch", type=int, default=1)
    p.add_argument("--speed-steps", type=int, default=48)
    p.add_argument("--speed-warmup", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.merge:
        rows, configs = [], []
        for path in args.merge:
            data = json.loads(Path(path).read_text())
            rows += data["rows"]
            configs.append(data["config"])
        Path(args.out).write_text(json.dumps({"config": configs, "rows": rows}, indent=1))
        return
    if args.speed_context is not None:
        if not 0 < args.budget < args.speed_context or args.speed_warmup >= args.speed_steps:
            raise SystemExit("speed-context: needs 0 < budget < speed-context and speed-warmup < speed-steps")
        torch.set_num_threads(args.threads)
        rows = speed_kvpress(args) if args.engine == "kvpress" else speed_ours(args)
        import transformers

        Path(args.out).write_text(json.dumps({"config": vars(args), "machine": {
            "machine": platform.machine(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads()}, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1))
        for r in rows:
            print(json.dumps({k: r.get(k) for k in ("engine", "method", "tokens_per_s", "step_s", "kv_bytes_end",
                                                      "kv_bytes_peak_decode", "prefill_s", "error")}))
        return
    if args.prompt >= args.budget:
        raise SystemExit(f"prompt: must be below the budget ({args.budget}), so that both caches start under it")
    torch.set_num_threads(args.threads)
    _, tok = load()
    ids = torch.tensor([tok(TEXT.read_text())["input_ids"][: args.tokens]])
    rows = run_kvpress(args, ids) if args.engine == "kvpress" else run_ours(args, ids)
    import transformers

    record = {"config": {**vars(args), "text": TEXT.name}, "machine": {
        "machine": platform.machine(), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads()}, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("engine", "method", "ppl", "tokens_per_s", "kv_bytes_end",
                                                  "kv_bytes_peak", "error")}))


if __name__ == "__main__":
    main()
