"""What a compressed cache kept of each planted key, and what the model answered from it.

For the passkey or multikey prompts of ``passkey_grid.py`` (the same lengths, depths, key count and trials
give the same prompts), and one cell of its ``--cells`` file: the prompt goes through the cell's cache, then,
before the question is answered, each planted fact's key tokens (those whose text holds a digit) are looked
up in every layer and KV head. Then the model answers greedily from that cache. One JSON line per prompt,
with the cell's name, the settings changed by ``--settings`` and the token budget:

- ``answer`` and ``asked``: the greedy answer's text and the asked key's; ``exact``: the answer starts with
  the asked key (what ``passkey_grid.py`` counts, by teacher forcing);
- per fact: its first token's position, its key, whether it was asked, ``kept`` (the share of
  (layer, KV head, key token) held) and ``whole`` (the share of (layer, KV head) holding all its key tokens)
  after the prompt, and ``whole_after`` once the answer is written (what decoding's own evictions left).

A lost key is then either evicted (``kept`` low, or ``whole_after`` below ``whole``) or held but outweighed by
another fact.

    python experiments/retrieval_probe.py --model qwen2.5-coder-0.5b --task multikey --keys 4 --trials 3 \
        --lengths 4096 --cells experiments/configs/passkey_qwen.json --cell "defaults 5x prompt-aware" \
        --items L4096-k2-t0,L4096-k2-t2
"""

import argparse
import json
import sys

import torch

from scissorhands import CacheSettings, budget_tokens, get_method
from scissorhands.core.layer.audit import held_by_head
from scissorhands.hf.scoring import ScoreSetup
from scissorhands.tools.eval.passkey import MultiKey, Passkey
from scissorhands.tools.models import load_model


def key_positions(tokenizer, ctx: list[int], span: tuple[int, int]) -> list[int]:
    """The positions in ``span`` whose token's text holds a digit: the key's tokens."""
    return [p for p in range(*span) if any(ch.isdigit() for ch in tokenizer.decode([ctx[p]]))]


def held(cache, positions: list[int]) -> torch.Tensor:
    """(layers, KV heads, len(positions)) bool: which key tokens each budgeted layer and head holds."""
    by_layer = held_by_head(cache)
    return torch.stack([by_layer[layer][:, positions] for layer in sorted(by_layer)])


def probe(model, tokenizer, item, method, budget, settings, protect: bool) -> dict:
    ctx, spans = item.data["ctx"], item.data["facts"]
    asked = tokenizer.decode(item.data["cont"]).strip()
    protected = tuple(tuple(s) for s in spans) if protect else None
    setup = ScoreSetup(method, budget, settings, protect=protected)
    new = len(item.data["cont"]) + 2
    cache = setup.make_cache(model, len(ctx) + new)
    ids = torch.tensor([ctx], device=model.device)
    with torch.no_grad():
        logits = model(ids, cache=cache, logits_to_keep=1).logits  # the prompt: what is kept is now fixed
    keys = [key_positions(tokenizer, ctx, span) for span in spans]

    def masks() -> list[torch.Tensor]:
        if not hasattr(cache, "budgeted_layers"):
            return [torch.ones(1, 1, len(k), dtype=torch.bool) for k in keys]
        return [held(cache, k) for k in keys]

    facts = []
    for i, (span, mask) in enumerate(zip(spans, masks())):
        facts.append({"fact": i, "at": span[0], "key": tokenizer.decode([ctx[k] for k in keys[i]]).strip(),
                      "kept": round(float(mask.float().mean()), 3),
                      "whole": round(float(mask.all(-1).float().mean()), 3)})
        facts[-1]["asked"] = facts[-1]["key"] == asked
    answer = [int(logits[0, -1].argmax())]
    with torch.no_grad():
        for step in range(new - 1):
            nxt = torch.tensor([[answer[-1]]], device=model.device)
            pos = torch.tensor([[len(ctx) + step]], device=model.device)
            answer.append(int(model(nxt, cache=cache, position_ids=pos).logits[0, -1].argmax()))
    for fact, mask in zip(facts, masks()):  # and once the answer is written: what decoding evicted since
        fact["whole_after"] = round(float(mask.all(-1).float().mean()), 3)
    text = tokenizer.decode(answer)
    return {"item": item.key, "asked": asked, "answer": text, "exact": text.strip().startswith(asked),
            "facts": facts}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--task", choices=("passkey", "multikey"), default="passkey")
    p.add_argument("--lengths", default="4096")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="passkey only")
    p.add_argument("--keys", type=int, default=4, help="multikey only")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--cells", required=True, help="a passkey_grid.py cells file")
    p.add_argument("--cell", required=True, help="the name of the cell to probe")
    p.add_argument("--settings", default="{}", help="JSON settings over the cell's (to try another)")
    p.add_argument("--items", default=None, help="comma list of prompt keys (default: every prompt)")
    args = p.parse_args(argv)
    cells = {c["name"]: c for c in json.loads(open(args.cells).read())}
    if args.cell not in cells:
        raise SystemExit(f"--cell: no cell {args.cell!r} in {args.cells}; choose from {', '.join(cells)}")
    try:
        extra = json.loads(args.settings)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--settings: not JSON ({exc.msg})") from None
    if not isinstance(extra, dict):
        raise SystemExit("--settings: must be a JSON object of settings")
    cell = cells[args.cell]
    method = get_method(cell["method"])
    try:
        settings = method.resolve(CacheSettings(**{**cell.get("settings", {}), **extra}))
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"--settings: {exc}") from None
    lengths = tuple(int(x) for x in args.lengths.split(","))
    task = MultiKey(lengths=lengths, keys=args.keys, trials=args.trials) if args.task == "multikey" else \
        Passkey(lengths=lengths, depths=tuple(float(x) for x in args.depths.split(",")), trials=args.trials)
    model, tok = load_model(args.model, dtype=args.dtype)
    items = task.items(tok, None)
    if args.items is not None:
        wanted = args.items.split(",")
        unknown = sorted(set(wanted) - {it.key for it in items})
        if unknown:
            raise SystemExit(f"--items: no prompt {unknown[0]!r}; the prompts are {', '.join(i.key for i in items)}")
        items = [it for it in items if it.key in wanted]
    for item in items:
        budget = None if cell["budget"] is None else budget_tokens(cell["budget"], item.length, settings)
        rec = {"cell": args.cell, "changed": extra, "budget": budget,
               **probe(model, tok, item, method, budget, settings, bool(cell.get("protect_facts", False)))}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
