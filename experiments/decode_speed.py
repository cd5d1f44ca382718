"""Decode speed of ScissorhandsCache against transformers' DynamicCache, same run, interleaved.

Reports median decode tokens/s over repeats (prefill excluded) and the ratio to
DynamicCache, for: no eviction (budget >= length), and eviction at a few budgets.

    python experiments/decode_speed.py --prompt-tokens 1024 --new-tokens 128 --repeats 5 --out docs/bench_decode.json

``--variants`` adds named settings on top of ``--settings`` (e.g. packed K/V
against dense), each at every budget, interleaved in the same run:

    python experiments/decode_speed.py --variants '{"dense": {}, "4-bit": {"kv_bits": 4}}'
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from scissorhands import CacheSettings
from scissorhands.tools.generation import demo_prompt, generate
from scissorhands.tools.models import load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="256,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--settings", default="{}",
                   help='JSON of CacheSettings fields, e.g. \'{"preset": "paper"}\' (default: the library defaults)')
    p.add_argument("--variants", default=None,
                   help='JSON {name: {CacheSettings fields}}: each on top of --settings, at every budget')
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    ids = tok(demo_prompt()).input_ids[: args.prompt_tokens]
    prompt = tok.decode(ids)
    total = args.prompt_tokens + args.new_tokens + 8
    base = json.loads(args.settings)
    named = json.loads(args.variants) if args.variants else {"": {}}
    variants = {"DynamicCache": None}
    for label, fields in named.items():
        settings = CacheSettings(**{**base, **fields})
        tag = f" ({label})" if label else ""
        variants[f"scissorhands{tag}, no eviction"] = settings.with_budget(total)
        for b in args.budgets.split(","):
            variants[f"scissorhands{tag}, budget {b}"] = settings.with_budget(int(b))
    # Warm-up, then interleave variants so drift on a shared machine hits all of them alike.
    for cfg in variants.values():
        generate(model, tok, prompt, cfg, max_new_tokens=8)
    runs = {name: [] for name in variants}
    prefill = {name: [] for name in variants}
    peak = {}
    for _ in range(args.repeats):
        for name, cfg in variants.items():
            r = generate(model, tok, prompt, cfg, max_new_tokens=args.new_tokens)
            if r.new_tokens.shape[1] < args.new_tokens:
                raise SystemExit(f"{name}: stopped early at {r.new_tokens.shape[1]} tokens (EOS)")
            runs[name].append(r.decode_tokens_per_second)
            prefill[name].append(r.prefill_seconds)
            if r.memory is not None:
                peak[name] = (r.memory["peak_stored"], r.memory["budgeted_kv_bytes"], r.memory["full_kv_bytes"])
    base = statistics.median(runs["DynamicCache"])
    rows = []
    print(f"| variant | decode tok/s (median of {args.repeats}) | ratio to DynamicCache | prefill s (median) "
          f"| peak tokens stored | KV bytes held / full |")
    print("|---|---|---|---|---|---|")
    for name in variants:
        med = statistics.median(runs[name])
        pk = peak.get(name)
        held = f"{pk[1] / pk[2]:.2f}" if pk else "1.00"
        print(f"| {name} | {med:.2f} | {med / base:.3f} | {statistics.median(prefill[name]):.2f} "
              f"| {pk[0] if pk else args.prompt_tokens + args.new_tokens} | {held} |")
        rows.append(dict(variant=name, decode_tps=runs[name], prefill_s=prefill[name], median=med, ratio=med / base))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=vars(args) | {"out": Path(args.out).name}, torch=torch.__version__,
                           threads=torch.get_num_threads(), machine=platform.machine(),
                           time=time.strftime("%Y-%m-%d %H:%M"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
