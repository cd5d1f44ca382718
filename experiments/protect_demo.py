"""A fact in the system prompt, a long conversation after it, then the question: is the fact still there?

Each trial puts "the access code is NNNNN" in the system prompt of the chat
template, then a user turn of about 2,000+ tokens of Shakespeare (a different
passage, code and wording per trial), then asks for the code. The whole
conversation runs through ``generate()`` with a budget of 20% of its length;
streamed prefill is exactly token-by-token decoding through the cache, so the
cache holds the budget for the whole conversation. Recall is the code appearing
in the greedy answer. Cells: the full cache, Scissorhands alone, and
Scissorhands with the system prompt protected; the audit of the unprotected
runs says when the code was evicted.

    python experiments/protect_demo.py --trials 20 --out docs/results/protect/trials.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from scissorhands import EvictionAudit, ScissorhandsConfig, get_method
from scissorhands.tools.generation import chat_prompt, generate
from scissorhands.tools.models import load_model
from scissorhands.tools.plots import plot_held_map
from scissorhands.tools.text import corpus_tokens, load_texts

SYSTEMS = [
    "You are a helpful assistant. The access code is {code}. Keep it in mind; the user will ask for it.",
    "You are a careful assistant. Remember this: the access code is {code}.",
    "Important: the access code is {code}. You will be asked for it at the end of the conversation.",
    "You help users with questions about plays. The access code is {code}; never forget it.",
]
ASK = "\n\nNow, what is the access code from the start of our conversation? Answer with the code only."


def build(tokenizer, filler: list[int], rng: random.Random, tokens: int) -> dict:
    code = str(rng.randint(10000, 99999))
    system = rng.choice(SYSTEMS).format(code=code)
    start = rng.randrange(0, len(filler) - tokens)
    passage = tokenizer.decode(filler[start:start + tokens])
    user = "Here is a passage from a play. Read it carefully.\n\n" + passage + ASK
    text, n_system = chat_prompt(tokenizer, system, user)
    text += "The access code is"
    enc = tokenizer(text, return_offsets_mapping=True)
    lo = text.index(code)
    code_tokens = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < lo + len(code) and b > lo]
    return {"code": code, "text": text, "n_system": n_system, "n_prompt": len(enc["input_ids"]),
            "code_span": (code_tokens[0], code_tokens[-1] + 1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--tokens", default="2000,2400", help="range of passage lengths in tokens")
    p.add_argument("--fraction", type=float, default=0.2, help="budget as a fraction of the conversation")
    p.add_argument("--method", default="scissorhands")
    p.add_argument("--preset", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, tok = load_model("smollm2-135m", dtype=args.dtype)
    filler = corpus_tokens(tok, load_texts(None))
    lo, hi = (int(x) for x in args.tokens.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["trial"], r["cell"]) for r in map(json.loads, out.read_text().splitlines())} if out.is_file() else set()
    method = get_method(args.method)
    for trial in range(args.trials):
        rng = random.Random(f"{args.seed}-{trial}")
        case = build(tok, filler, rng, rng.randint(lo, hi))
        budget = round(args.fraction * case["n_prompt"])
        config = method.configure(ScissorhandsConfig(budget=budget, preset=args.preset).settings, budget)
        cells = {"full": None, "scissorhands": [], "scissorhands + protect-system": [(0, case["n_system"])]}
        for cell, protect in cells.items():
            if (trial, cell) in done:
                continue
            audit = EvictionAudit(spans={"system": (0, case["n_system"]), "code": case["code_span"]})
            start = time.perf_counter()
            result = generate(model, tok, case["text"], None if cell == "full" else config, max_new_tokens=8,
                              method=method(), protect=protect, audit=None if cell == "full" else audit)
            answer = result.texts[0]
            rec = {"trial": trial, "cell": cell, "code": case["code"], "answer": answer,
                   "recalled": case["code"] in answer.replace(" ", ""), "n_prompt": case["n_prompt"],
                   "n_system": case["n_system"], "code_span": case["code_span"], "budget": budget,
                   "settings": config.as_dict(), "method": args.method, "wall_s": time.perf_counter() - start}
            if cell != "full":
                summary = audit.summary(result.cache)
                rec["audit"] = {name: summary["spans"][name] for name in ("system", "code")}
                if trial == 0:
                    png = out.with_name(f"held-{cell.replace(' + ', '-').replace(' ', '-')}.png")
                    plot_held_map(result.cache, png, spans={"system": (0, case["n_system"])})
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            first = rec.get("audit", {}).get("code", {}).get("first_evicted_step_any_layer")
            print(f"trial {trial:2d} {cell:<32} {'recalled' if rec['recalled'] else 'lost    '} "
                  f"{answer!r:<28} code first evicted at {first} ({rec['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
