"""Exact scorer against token-by-token decoding through the same cache, on real text.

Both give the same log-probs (checked here too); the scorer computes each layer
for all positions at once, with one block per compression event.

    python experiments/scorer_speed.py --seq-len 2048 --budget 0.2 --out docs/bench_scorer.json
"""

import argparse
import json
import time

import torch

from scissorhands import CacheSettings, budget_tokens, get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs
from scissorhands.tools.models import load_model
from scissorhands.tools.text import shakespeare_tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model, tok = load_model(args.model)
    ids = torch.tensor(shakespeare_tokens(tok, max_tokens=args.seq_len)[: args.seq_len])
    base = CacheSettings()
    budget = budget_tokens(args.budget, len(ids), base)
    setup = ScoreSetup(get_method(args.method), budget, base)

    token_logprobs(model, ids[:256], setup)  # warm-up
    fast_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fast, _ = token_logprobs(model, ids, setup)
        fast_times.append(time.perf_counter() - t0)

    cache = setup.make_cache(model, len(ids))
    slow = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in range(len(ids) - 1):
            logits = model(ids[None, t:t + 1], cache=cache).logits[0, -1]
            slow.append(torch.log_softmax(logits.float(), -1)[ids[t + 1]])
    slow_time = time.perf_counter() - t0
    slow = torch.stack(slow)
    fast_med = sorted(fast_times)[len(fast_times) // 2]
    res = dict(config=vars(args), budget_tokens=budget, scorer_seconds=fast_times, decode_seconds=slow_time,
               speedup=slow_time / fast_med, max_abs_logprob_diff=float((fast - slow).abs().max()),
               mean_nll=float(-fast.mean()), threads=torch.get_num_threads(), torch=torch.__version__)
    print(f"| T | budget | scorer s (median of {args.repeats}) | decode s | speed-up | max abs log-prob diff |")
    print("|---|---|---|---|---|---|")
    print(f"| {len(ids)} | {budget} | {fast_med:.2f} | {slow_time:.1f} | {res['speedup']:.1f}x "
          f"| {res['max_abs_logprob_diff']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
