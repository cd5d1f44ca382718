"""A passkey in a long prompt, through vLLM's OpenAI server: full cache, the plugin at 5x, and a protected span.

Each prompt is a 5-digit key stated at its start, real text, then the question; the completion must contain
the key. The key sits near the start, so that ``protect_prefix`` can cover it: the third variant pins the
prompt's first tokens (where the key is) in every layer and KV head.

    .venv-vllm/bin/python experiments/vllm_passkey.py --model FOLDER --prompts 5 --length 2048 \\
        --compression 5 --out docs/vllm/passkey.json

With ``--depths``, the prompts are instead those of the transformers path's passkey task
(:class:`scissorhands.tools.eval.passkey.Passkey`, as ``experiments/passkey_grid.py`` scores them), token for
token: one per depth, sent as token ids, and a key counts when the greedy completion is the answer's tokens
exactly. The key then sits inside the text, where a protected prefix cannot reach, so the protected variant
is not run.

Runs in the vLLM environment; starts one server per variant on a free local port.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

HAMLET = Path(__file__).resolve().parent.parent / "src" / "scissorhands" / "tools" / "data" / "hamlet_act1.txt"


def prompts(tokenizer, text: str, n: int, length: int, seed: int) -> list[tuple[str, str, int]]:
    """(prompt, key, tokens before the end of the key's sentence), ``length`` tokens each."""
    rng = random.Random(seed)
    ids = tokenizer(text)["input_ids"]
    out = []
    for _ in range(n):
        key = f"{rng.randrange(10000, 100000)}"
        head = f"Remember this: the pass key is {key}. The pass key is {key}.\n\n"
        tail = "\n\nWhat is the pass key? The pass key is"
        room = length - len(tokenizer(head + tail)["input_ids"])
        start = rng.randrange(0, max(1, len(ids) - room))
        filler = tokenizer.decode((ids[start:] + ids)[:room])
        out.append((head + filler + tail, key, len(tokenizer(head)["input_ids"])))
    return out


def serve(model: str, plugin: dict | None, port: int, log):
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "8192", "--port", str(port), "--served-model-name", "m",
            "--no-enable-prefix-caching"]
    if plugin is not None:
        args += ["--additional-config", json.dumps({"scissorhands": plugin})]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ}  # a KV space of its own, not 92% of the machine
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit("vllm_passkey: error: the server stopped; see its log") from None
            time.sleep(1)
    raise SystemExit("vllm_passkey: error: the server did not start in 300 s")


def grid_prompts(tokenizer, length: int, depths: tuple[float, ...], trials: int) -> list[tuple[list[int], str, int]]:
    """The transformers path's passkey prompts: (context ids, the answer's text, the answer's token count)."""
    from scissorhands.tools.eval.passkey import Passkey

    items = Passkey(lengths=(length,), depths=depths, trials=trials).items(tokenizer, None)
    return [(it.data["ctx"], tokenizer.decode(it.data["cont"]), len(it.data["cont"])) for it in items]


def complete(port: int, prompt: str | list[int], max_tokens: int = 8) -> str:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def _exactly(want: str) -> Callable[[str], bool]:
    return lambda answer: answer == want


def _containing(key: str) -> Callable[[str], bool]:
    return lambda answer: key in answer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a safetensors model folder")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--length", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--compression", type=float, default=5.0)
    p.add_argument("--text", default=str(HAMLET))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depths", default=None,
                   help="comma-separated depths: the transformers path's passkey prompts instead (--prompts is then "
                        "the trials per depth, --text and --seed unused)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    budget = round(args.length / args.compression)
    cases: list[tuple[str | list[int], int, Callable[[str], bool]]]  # prompt, tokens to generate, recalled?
    if args.depths:
        try:
            depths = tuple(float(d) for d in args.depths.split(","))
        except ValueError:
            raise SystemExit(f"vllm_passkey: error: --depths: comma-separated numbers, got {args.depths!r}") from None
        # the answer's tokens exactly, as the transformers path scores it
        grid = grid_prompts(tokenizer, args.length, depths, args.prompts)
        cases = [(ids, n, _exactly(want)) for ids, want, n in grid]
        variants = {"full cache": None, f"scissorhands, budget {budget}": {"budget": budget}}
        prefix = 0
    else:
        made = prompts(tokenizer, Path(args.text).read_text(), args.prompts, args.length, args.seed)
        cases = [(prompt, 8, _containing(key)) for prompt, key, _ in made]
        prefix = max(n for _, _, n in made) + 1
        variants = {"full cache": None, f"scissorhands, budget {budget}": {"budget": budget},
                    f"scissorhands, budget {budget}, first {prefix} tokens protected": {"budget": budget,
                                                                                        "protect_prefix": prefix}}
    rows = {}
    for name, plugin in variants.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = serve(args.model, plugin, port, subprocess.DEVNULL)
        try:
            answers = [complete(port, prompt, max_tokens) for prompt, max_tokens, _ in cases]
        finally:
            server.terminate()
            server.wait(timeout=60)
        hits = [recalled(answer) for (_, _, recalled), answer in zip(cases, answers)]
        rows[name] = {"recalled": sum(hits), "of": len(hits), "answers": answers}
        print(f"{name}: {sum(hits)}/{len(hits)}", flush=True)
    record = {"config": vars(args) | {"budget": budget, "protect_prefix": prefix}, "variants": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
