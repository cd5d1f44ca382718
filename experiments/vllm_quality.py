"""Perplexity through vLLM with the plugin, against vLLM's full cache and the transformers path, teacher-forced.

Each window of real text is one request: its first ``--prompt`` tokens are the prompt (held and evicted
to the budget once, as the plugin does), and every later token is forced as the next one, so the
log-probability vLLM reports for it (raw, before the forcing processor) is the teacher-forced one, decoded
token by token through the evicting cache. The transformers side feeds the same windows through
``ScissorhandsCache`` at the same settings. Run the two sides in their own environments, then compare:

    .venv-vllm/bin/python experiments/vllm_quality.py --engine vllm --model FOLDER --text FILE \
        --out docs/vllm/quality_vllm.json
    python experiments/vllm_quality.py --engine transformers --model FOLDER --text FILE \
        --out docs/vllm/quality_hf.json
    python experiments/vllm_quality.py --compare docs/vllm/quality_vllm.json docs/vllm/quality_hf.json

Windows, budgets and settings are the same on both sides (``--seq-len``, ``--windows``, ``--compression``,
``--prompt``); the text is tokenized by the model folder's tokenizer on both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def windows(model: str, text_path: str, seq_len: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(Path(text_path).read_text())["input_ids"]
    step = max(seq_len, (len(ids) - seq_len) // max(1, count))
    out = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, step)][:count]
    if len(out) < count:
        raise SystemExit(f"vllm_quality: error: text: {len(ids)} tokens hold only {len(out)} windows of {seq_len}")
    return out


def plugin_settings(args) -> dict:
    plugin = {"budget": round(args.seq_len / args.compression), "method": args.method}
    if args.drop is not None:
        plugin["drop"] = float(args.drop) if "." in args.drop else int(args.drop)
    return plugin


def grid(args) -> list[tuple[str, dict | None, str]]:
    """``--grid`` items as (name, plugin settings or None, vLLM's kv_cache_dtype): ``full``, or a compression
    such as ``5``, each optionally followed by ``:drop1`` (a round every step: the per-step semantics) and
    ``:fp8`` (vLLM's 8-bit K/V)."""
    out = []
    for item in args.grid.split(","):
        head, *flags = item.strip().split(":")
        if set(flags) - {"drop1", "fp8"}:
            raise SystemExit(f"vllm_quality: error: --grid: unknown flag in {item!r} (drop1, fp8)")
        kv = "fp8" if "fp8" in flags else "auto"
        if head == "full":
            out.append((item, None, kv))
            continue
        try:
            plugin = {"budget": round(args.seq_len / float(head)), "method": args.method}
        except ValueError:
            raise SystemExit(f"vllm_quality: error: --grid: expected 'full' or a compression, got {head!r}") from None
        if "drop1" in flags:
            plugin["drop"] = 1
        elif args.drop is not None:
            plugin["drop"] = float(args.drop) if "." in args.drop else int(args.drop)
        out.append((item, plugin, kv))
    return out


def run_vllm(args, texts) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForceNext(AdapterLogitsProcessor):
        """The next token of the request's ``force`` list is the only one allowed."""

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            force = (params.extra_args or {}).get("force")
            if force is None:
                return None

            def step(output_ids, logits):
                keep = logits.new_full(logits.shape, float("-inf"))
                keep[force[len(output_ids)]] = 0
                return logits + keep

            return step

    out = {}
    runs = grid(args) if args.grid else [("full", None, "auto"), ("scissorhands", plugin_settings(args), "auto")]
    for name, plugin, kv_dtype in runs:
        kw = dict(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.seq_len + 8, seed=0,
                  enable_prefix_caching=False, enable_chunked_prefill=False, logits_processors=[ForceNext],
                  max_num_seqs=len(texts), kv_cache_dtype=kv_dtype)
        if plugin is not None:
            kw["additional_config"] = {"scissorhands": plugin}
        llm = LLM(**kw)
        reqs = [TokensPrompt(prompt_token_ids=w[: args.prompt]) for w in texts]
        params = [SamplingParams(temperature=0.0, max_tokens=len(w) - args.prompt, logprobs=0, ignore_eos=True,
                                 extra_args={"force": w[args.prompt :]}) for w in texts]
        results = llm.generate(reqs, params, use_tqdm=False)
        nll = []
        for w, r in zip(texts, results):
            assert list(r.outputs[0].token_ids) == w[args.prompt :], "the forcing processor did not hold"
            lps = [d[t].logprob for d, t in zip(r.outputs[0].logprobs, w[args.prompt :])]
            nll.append(-statistics.mean(lps[1:]))  # the first is the prompt's last prediction, held exactly
        out[name] = nll
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.manual_seed(0)
    return out


def run_transformers(args, texts) -> dict:
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from scissorhands import ScissorhandsCache
    from scissorhands.vllm.settings import parse

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    settings = parse(plugin_settings(args))
    configs = {"scissorhands": settings.config}
    if args.per_step:  # the per-step semantics the plugin ran before rounds: one token dropped at every step
        configs["scissorhands-per-step"] = replace(settings.config, rounds=False, drop=1)
    out = {}
    for name in ("full", *configs)[1 - args.with_full:]:
        nll = []
        for w in texts:
            cache = DynamicCache(config=model.config) if name == "full" else ScissorhandsCache(
                model, configs[name], settings.method())
            ids = torch.tensor([w])
            with torch.no_grad():
                model(ids[:, : args.prompt], cache=cache)
                lps = []
                for t in range(args.prompt, len(w) - 1):
                    logits = model(ids[:, t : t + 1], cache=cache).logits[0, -1]
                    lps.append(float(torch.log_softmax(logits.float(), -1)[w[t + 1]]))
            nll.append(-statistics.mean(lps))
        out[name] = nll
    return out


def compare(a_path: str, b_path: str) -> None:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    lines = ["| engine | full cache NLL (ppl) | scissorhands NLL (ppl) | ΔNLL vs its full cache |", "|---|---|---|---|"]
    for rec in (a, b):
        ours = statistics.mean(rec["nll"]["scissorhands"])
        if "full" not in rec["nll"]:
            lines.append(f"| {rec['engine']} | (not run) | {ours:.4f} ({math.exp(ours):.2f}) | |")
            continue
        full = statistics.mean(rec["nll"]["full"])
        lines.append(f"| {rec['engine']} | {full:.4f} ({math.exp(full):.2f}) | {ours:.4f} ({math.exp(ours):.2f}) | "
                     f"{ours - full:+.4f} |")
    if "scissorhands-per-step" in b["nll"]:
        step = statistics.mean(b["nll"]["scissorhands-per-step"])
        paired = [x - y for x, y in zip(b["nll"]["scissorhands"], b["nll"]["scissorhands-per-step"])]
        lines.append(f"| {b['engine']}, per step (rounds off, drop 1) | | {step:.4f} ({math.exp(step):.2f}) | rounds "
                     f"against it: {statistics.mean(paired):+.4f} (windows {min(paired):+.4f} to "
                     f"{max(paired):+.4f}) |")
    diffs = [x - y for x, y in zip(a["nll"]["scissorhands"], b["nll"]["scissorhands"])]
    lines.append("")
    lines.append(f"vLLM plugin against the transformers path at the same settings, per window: mean "
                 f"{statistics.mean(diffs):+.6f} nats, largest {max(abs(d) for d in diffs):.6f}")
    print("\n".join(lines))


def summary(path: str) -> None:
    """Per engine of a ``--grid`` record: mean NLL and, paired over windows (mean, lowest to highest), its ΔNLL
    against vLLM's full cache, against the full cache of the same K/V (fp8 or not), and, for a compression
    without ``:drop1``, its rounds against the same compression with a round every step."""
    nll = json.loads(Path(path).read_text())["nll"]
    lines = ["| engine | NLL (ppl) | ΔNLL vs full cache | ΔNLL vs full cache, same K/V | rounds vs per step |",
             "|---|---|---|---|---|"]

    def paired(name: str, other: str) -> str:
        if other not in nll or other == name:
            return ""
        d = [x - y for x, y in zip(nll[name], nll[other])]
        return f"{statistics.mean(d):+.4f} ({min(d):+.4f} to {max(d):+.4f})"

    for name, values in nll.items():
        head, *flags = name.split(":")
        fp8 = [":fp8"] if "fp8" in flags else []
        rounds = "" if "drop1" in flags else paired(name, head + ":drop1" + "".join(fp8))
        mean = statistics.mean(values)
        lines.append(f"| {name} | {mean:.4f} ({math.exp(mean):.2f}) | {paired(name, 'full')} | "
                     f"{paired(name, 'full' + ''.join(fp8)) if fp8 else ''} | {rounds} |")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "transformers"))
    p.add_argument("--model", help="a safetensors model folder")
    p.add_argument("--text", help="a text file")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64, help="the prompt of each window (the rest is forced)")
    p.add_argument("--compression", type=float, default=5.0)
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--drop", default=None, help="the plugin's drop amount (fraction or count); default the library's")
    p.add_argument("--per-step", action="store_true",
                   help="transformers side: also the per-step semantics (rounds off, drop 1), for the rounds' cost")
    p.add_argument("--with-full", type=int, choices=(0, 1), default=1,
                   help="transformers side: also score the full cache (0: the budgeted cache only)")
    p.add_argument("--grid", default=None,
                   help="vLLM side: engines to run, e.g. full,full:fp8,5,5:drop1,5:fp8,10,10:drop1 (a compression, "
                        "':drop1' for a round every step, ':fp8' for vLLM's 8-bit K/V); default full and --compression")
    p.add_argument("--summary", metavar="VLLM_JSON", help="a --grid record's table: ΔNLL of each engine, paired")
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2, metavar=("VLLM_JSON", "HF_JSON"))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.summary:
        return summary(args.summary)
    if not (args.engine and args.model and args.text):
        p.error("--engine, --model and --text are needed to measure")
    texts = windows(args.model, args.text, args.seq_len, args.windows)
    nll = run_vllm(args, texts) if args.engine == "vllm" else run_transformers(args, texts)
    record = {"engine": args.engine, "config": vars(args) | {"plugin": plugin_settings(args)}, "nll": nll}
    print(json.dumps(record["nll"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
