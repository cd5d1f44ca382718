"""``scissorhands eval``: methods x budgets x tasks, each row written as it finishes and resumable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from scissorhands.core.settings.config import CacheSettings

from ..paths import check_apart
from .checks import MAX_SEED, check_model_args, check_range, input_files
from .parser import cache_settings


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name}: expected a comma list of numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{name}: is empty")
    return values


def _names(text: str, name: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name}: is empty")
    twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
    if twice is not None:
        raise ValueError(f"{name}: {twice!r} is given twice")
    return items


def _eval_budgets(args, base: CacheSettings, methods) -> list[float | int]:
    """``--budgets`` checked against the settings: finite, distinct, and token counts above the protected tokens."""
    from scissorhands.core.settings.budget import check_budget_spec

    if args.budgets is None:
        args.budgets = "" if args.memory is not None else "0.1,0.2,0.33,0.5"
    budgets: list = ([check_budget_spec(b, "budgets") for b in _floats(args.budgets, "budgets")]
                     if args.budgets else [])
    if args.memory is not None:
        from scissorhands.core.planning.memory_target import parse_memory

        from ..eval.runner import MemorySpec

        specs = [MemorySpec(parse_memory(m.strip())) for m in args.memory.split(",") if m.strip()]
        if not specs:
            raise ValueError("memory: is empty")
        budgets += specs
    twice = next((b for i, b in enumerate(budgets) if b in budgets[:i]), None)
    if twice is not None:
        raise ValueError(f"budgets: {twice} is given twice")
    from scissorhands.core.planning.assembly import check_budget

    for m in methods:  # the plan's rule, before the model loads: a count above each method's protected tokens
        if not m.is_full:
            for b in budgets:
                if isinstance(b, int):  # a fraction is floored per item, not refused
                    check_budget(b, base, m, "budgets")
    return budgets


def run(args) -> int:
    from ..eval import make_task, plot_results, run_grid
    from ..eval.catalog import GENERATED
    from ..eval.records import RESULTS_FILE, check_results_file
    from ..eval.report import folder_results, summary_markdown
    from ..models import load_model
    from ..paths import check_output_folder
    from ..text import load_texts

    base = cache_settings(args)
    from scissorhands.core.planning.assembly import check_plan

    check_plan(base)  # the plan's rules on the settings alone (a schedule file read), before the model loads
    from scissorhands.core.methods import get_method

    methods = [get_method(m) for m in _names(args.methods, "methods")]
    budgets = _eval_budgets(args, base, methods)
    if isinstance(base.schedule, tuple) and len(budgets) > 1:
        # An explicit list fixes every layer's budget: several --budgets would be the same cache under other names.
        raise ValueError(f"schedule: an explicit list of per-layer budgets fixes the budget, so --budgets takes one "
                         f"value with it, got {len(budgets)}")
    if args.limit is not None:
        check_range("limit", args.limit, 1)
    check_range("seq-len", args.seq_len, 2)
    check_range("num-samples", args.num_samples, 1)
    check_range("seed", args.seed, 0, MAX_SEED)
    check_model_args(args)
    names = _names(args.tasks, "tasks")
    if args.text is not None:
        if not Path(args.text).expanduser().exists():
            raise ValueError(f"text: no such file or folder {args.text!r}")
        if not all(n in GENERATED for n in names):  # the generated tasks read (and check) a .jsonl(.gz) of problems
            load_texts(args.text, "text")  # binary or empty text is refused now, not after the model loads
    tasks = [make_task(t, args.seq_len, args.num_samples, args.text, args.protect_structure) for t in names]
    for task in tasks:
        check = getattr(task, "check", None)
        if check is not None:
            check()
    engine = None
    if args.engine != "transformers":
        import dataclasses

        from ..eval.engine import VLLMEngine, check_engine_grid
        from ..eval.records import generation_ends

        base = dataclasses.replace(base, rounds=True)  # the plugin's eviction, which the transformers rows name
        check_engine_grid(args.engine, tasks, methods, budgets, base)
    if args.out is None:
        args.out = Path("eval-out")
        print(f"eval: results go to {args.out}{os.sep} (the default; choose another folder with --out)",
              file=sys.stderr)
    files = (RESULTS_FILE, "summary.md", *(f"{t.name}.png" for t in tasks))
    out = check_output_folder(args.out, "out", files)
    check_apart({"out": [out / f for f in files]}, input_files(args))
    check_results_file(out / RESULTS_FILE)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.engine != "transformers":
        engine = VLLMEngine(str(model.name_or_path), args.dtype, ends=generation_ends(model))
    results = run_grid(model, tokenizer, model_name=args.model, tasks=tasks, methods=methods, budgets=budgets,
                       base=base, out_dir=out, limit=args.limit, seed=args.seed, resume=not args.no_resume,
                       engine=engine)
    shown = folder_results(out / RESULTS_FILE, results)
    if len(shown) > len(results):
        extra = len(shown) - len(results)
        print(f"summary: also shows {extra} {'row' if extra == 1 else 'rows'} of earlier runs into {out} "
              "measured the same way", file=sys.stderr)
    summary = summary_markdown(shown)
    print(summary)
    (out / "summary.md").write_text(summary + "\n")
    for path in plot_results(shown, out):
        print(f"plot: {path}", file=sys.stderr)
    print(f"results: {out / RESULTS_FILE}", file=sys.stderr)
    return 0
