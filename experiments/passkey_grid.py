"""Passkey recall for methods x prefill modes x budgets, through the exact scorer.

Each (method, prefill, budget) cell scores the same prompts (a 5-digit key
planted at several depths of Shakespeare filler, lengths 1k-4k tokens; or, with
``--task multikey``, several named keys with one asked); one JSON line per
cell, resumable (a cell cut off midway resumes at its first unscored prompt: the scored ones wait in
``<out>.partial/``). A run into a file made with another model, dtype, task,
lengths, depths, key count or trials is refused, and so is a cell whose name is there
with other settings. A cell with ``"protect_facts": true`` scores with the
planted facts as protected spans.

    python experiments/passkey_grid.py --cells experiments/configs/passkey_cells.json \
        --out docs/results/passkey/results.jsonl
"""

import argparse
import json
import time
from pathlib import Path

from scissorhands import CacheSettings, budget_tokens, get_method
from scissorhands.hf.scoring import ScoreSetup
from scissorhands.tools.eval.passkey import MultiKey, Passkey
from scissorhands.tools.eval.records import Partial, key_id
from scissorhands.tools.models import load_model
from scissorhands.tools.paths import check_same_run


def check_same_cell(out: Path, record: dict, cell: dict) -> None:
    """Refuse a cell whose name is in ``out`` with another method, budget, protection or setting.

    Only the settings the record holds are compared (an older record lacks the newer ones).
    """
    settings = json.loads(json.dumps(get_method(cell["method"]).resolve(
        CacheSettings(**cell.get("settings", {}))).as_dict()))
    same = (record.get("method") == cell["method"] and record.get("budget") == cell["budget"]
            and bool(record.get("protect_facts", False)) == bool(cell.get("protect_facts", False))
            and all(settings.get(k) == v for k, v in record.get("settings", {}).items() if k in settings))
    if not same:
        raise SystemExit(f"--cells: cell {cell['name']!r} is in {out} with other settings; rename the cell or "
                         "choose another --out")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--cells", required=True,
                   help='JSON list of {"name", "method", "budget" (fraction or null), "settings": {...}}')
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", choices=("passkey", "multikey"), default="passkey")
    p.add_argument("--keys", type=int, default=4, help="multikey: facts per prompt (one is asked)")
    p.add_argument("--trials", type=int, default=1,
                   help="prompts per (length, depth) for passkey, per (length, asked key) for multikey; each trial "
                        "draws its own filler, keys and names")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cells = json.loads(Path(args.cells).read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    depths = tuple(float(x) for x in args.depths.split(","))
    run: dict[str, object] = {"model": args.model, "dtype": args.dtype, "task": args.task, "lengths": lengths}
    run.update({"keys": args.keys} if args.task == "multikey" else {"depths": depths})
    if args.trials != 1:  # runs of one trial were recorded before the option existed, and pair with a new one
        run["trials"] = args.trials
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    check_same_run(out, records, run)
    done = {r["name"]: r for r in records}
    for cell in cells:  # a cell renamed in place would be skipped as done: refuse it before any work
        if cell["name"] in done:
            check_same_cell(out, done[cell["name"]], cell)
    model, tok = load_model(args.model, dtype=args.dtype)
    task = MultiKey(lengths=lengths, keys=args.keys, trials=args.trials) if args.task == "multikey" else \
        Passkey(lengths=lengths, depths=depths, trials=args.trials)
    items = task.items(tok, None)
    for cell in cells:
        if cell["name"] in done:
            continue
        method = get_method(cell["method"])
        settings = method.resolve(CacheSettings(**cell.get("settings", {})))
        task.protect_facts = bool(cell.get("protect_facts", False))
        digest = key_id(json.loads(json.dumps({**run, **cell, "settings": settings.as_dict()})))
        partial = Partial(out.with_name(out.name + ".partial") / f"{digest}.jsonl", items, resume=True)
        earlier, start = partial.wall_s, time.perf_counter()
        scores = list(partial.scores)
        for index, item in enumerate(items[len(scores):], start=len(scores)):
            budget = None if cell["budget"] is None else budget_tokens(cell["budget"], item.length, settings)
            scores.append(task.score(model, item, ScoreSetup(method, budget, settings)))
            partial.add(index, item, scores[-1], earlier + time.perf_counter() - start)
        metrics = task.aggregate(scores)
        rec = {**cell, "settings": settings.as_dict(), "metrics": metrics, "item_scores": scores,
               **run, "wall_s": earlier + time.perf_counter() - start}
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        partial.remove()
        print(f"{cell['name']:<40} acc {metrics['acc']:.3f} by length {metrics['by_length']} "
              f"({rec['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
