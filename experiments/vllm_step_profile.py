"""One engine step of vLLM, with and without the plugin, timed and profiled (torch profiler), ample memory.

R requests with prompts of 480-500 tokens of *Hamlet* are submitted at once; after a warm-up of 60 steps
(prompts done, windows full, rounds running) 40 steps are timed one by one and 10 more profiled. It prints
the median step time and the operators by their own CPU time.

    .venv-vllm/bin/python experiments/vllm_step_profile.py --model FOLDER --variant vllm
    .venv-vllm/bin/python experiments/vllm_step_profile.py --model FOLDER --variant scissorhands --budget 490
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a safetensors model folder")
    p.add_argument("--variant", choices=("vllm", "scissorhands"), required=True)
    p.add_argument("--requests", type=int, default=28)
    p.add_argument("--budget", type=int, default=490)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_serving import HAMLET, make_requests

    reqs = make_requests(AutoTokenizer.from_pretrained(args.model), HAMLET.read_text(), args.requests, (480, 500),
                         (400, 400), 0)
    eargs = dict(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=64, seed=0,
                 enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=16384)
    if args.variant == "scissorhands":
        eargs["additional_config"] = {"scissorhands": {"budget": args.budget}}
    engine = LLM(**eargs).llm_engine
    for i, (ids, new) in enumerate(reqs):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids),
                           SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    for _ in range(60):
        engine.step()
    times = []
    for _ in range(40):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(f"{args.variant}: step median {1e3 * statistics.median(times):.1f} ms, min {1e3 * min(times):.1f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    print(f"{args.variant}: torch operators a step (aten::, nested ones included) {calls / 10:.0f}")
    engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
