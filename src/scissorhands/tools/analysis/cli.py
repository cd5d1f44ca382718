"""``scissorhands analyze``: persistence, power law, calibrated budgets and the bound on one model.

Options are parsed as text and checked in :func:`settings_from_args`, so a bad
value is a ``ValueError`` whose message starts with the option's name.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from ..cliargs import alias
from .settings import PARTS, AnalysisSettings

# What ``analyze`` writes into --out (checked before any work starts).
_OUTPUT_FILES = ("analysis.json", "tables.md", "persistence.png", "powerlaw.png", "bound.png", "schedule.png",
                 "calibrated_schedule.json")


def add_parser(subparsers):
    """Add the ``analyze`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser("analyze", allow_abbrev=False,
                              help="persistence of importance, power law, calibrated budgets, deviation vs budget")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded default), a Hugging Face id, a folder or a .gguf file")
    p.add_argument("--text", default=None, help="text file or folder (default: Shakespeare's plays)")
    p.add_argument("--seq-len", default="256,512,1024",
                   help="comma list of lengths T for persistence; the largest is used for the maps, "
                   "power law and bound")
    p.add_argument("--num-samples", default="8",
                   help="text samples of --seq-len tokens for persistence and power law (not the history --window)")
    alias(p, "--windows", "--num-samples", "num_samples")
    p.add_argument("--thresholds", default="1,2,5,10", help="form (a) thresholds as multiples of 1/t")
    p.add_argument("--topk", default="5,10,20,30", help="form (b) top sets, percent of the first half")
    p.add_argument("--calib-topk", default="10", help="form (b) top-set percent that drives calibration")
    p.add_argument("--budget", default="0.2",
                   help="average budget of the calibrated schedule: fraction of --ppl-seq-len (<=1) or tokens")
    p.add_argument("--weight-floor", default="0.1", help="added to each layer's weight 1 - persistence")
    p.add_argument("--ratios", default="0.1,0.2,0.3,0.5,0.7,1.0", help="B/T values for the bound analysis")
    p.add_argument("--bound-samples", default="2", help="text samples for the bound analysis")
    alias(p, "--bound-windows", "--bound-samples", "bound_samples")
    p.add_argument("--ppl-seq-len", default="2048", help="window length for the schedule perplexity comparison")
    p.add_argument("--ppl-samples", default="16", help="text samples for the schedule perplexity comparison")
    alias(p, "--ppl-windows", "--ppl-samples", "ppl_samples")
    p.add_argument("--compressions", default="3,5", help="compression factors T/budget for the comparison")
    p.add_argument("--calib-fraction", default="0.5",
                   help="share of the corpus tokens (from the start) used for calibration; the rest evaluates")
    p.add_argument("--rank-lo", default="2", help="first rank of the power-law fit (the last is T/2)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--bos", action="store_true", help="start every window with the tokenizer's BOS token")
    p.add_argument("--seed", default="0", help="seed of the randomly initialised control model")
    p.add_argument("--out", default="analysis-out", help="output folder for JSON and PNG files")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--from-json", default=None,
                   help="measure nothing: redraw plots and tables into --out from an earlier analysis.json")
    return p


def _number(text: str, name: str, kind=float):
    try:
        value = kind(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {text!r}")
    return value


def _numbers(text: str, name: str, kind=float) -> tuple:
    items = [x for x in str(text).split(",") if x.strip()]
    if not items:
        raise ValueError(f"{name}: is empty")
    return tuple(_number(x, name, kind) for x in items)


def settings_from_args(args) -> AnalysisSettings:
    """Build validated settings from the parsed options (raises ValueError naming the option)."""
    topk = tuple(k / 100 for k in _numbers(args.topk, "topk"))
    for k in topk:
        if not 0.0 < k <= 1.0:
            raise ValueError(f"topk: must be in (0, 100] percent, got {k * 100:g}")
    calib = _number(args.calib_topk, "calib-topk") / 100
    if not any(abs(calib - k) < 1e-12 for k in topk):
        raise ValueError(f"calib-topk: must be one of --topk ({args.topk}), got {args.calib_topk}")
    calib = next(k for k in topk if abs(calib - k) < 1e-12)
    return AnalysisSettings(
        seq_lens=_numbers(args.seq_len, "seq-len", int),
        windows=_number(args.num_samples, "num-samples", int),
        thresholds=_numbers(args.thresholds, "thresholds"),
        topk=topk,
        calib_topk=calib,
        budget=_number(args.budget, "budget"),
        weight_floor=_number(args.weight_floor, "weight-floor"),
        ratios=_numbers(args.ratios, "ratios"),
        bound_windows=_number(args.bound_samples, "bound-samples", int),
        ppl_seq_len=_number(args.ppl_seq_len, "ppl-seq-len", int),
        ppl_windows=_number(args.ppl_samples, "ppl-samples", int),
        compressions=_numbers(args.compressions, "compressions"),
        calib_fraction=_number(args.calib_fraction, "calib-fraction"),
        rank_lo=_number(args.rank_lo, "rank-lo", int),
        seed=_number(args.seed, "seed", int),
        bos=bool(args.bos),
        parts=tuple(p.strip() for p in str(args.parts).split(",") if p.strip()),
    )


def run(args) -> int:
    """Run ``scissorhands analyze``; writes ``analysis.json``, the calibrated schedule and plots to ``--out``."""
    from ..models import load_model
    from ..paths import check_output_folder
    from ..text import load_texts
    from .pipeline import analyze
    from .report import save_json

    if args.from_json is not None:
        result = _read_result(Path(args.from_json))
        out = check_output_folder(args.out, "out", _OUTPUT_FILES)
        return _redraw(result, out)
    settings = settings_from_args(args)  # check every option before the slow model load
    if args.text is not None and args.text != "shakespeare" and not Path(args.text).expanduser().exists():
        raise ValueError(f"text: no such file or folder {args.text!r}")
    texts = load_texts(args.text, "text")
    if not str(args.model).strip():
        raise ValueError("model: is empty")
    out = check_output_folder(args.out, "out", _OUTPUT_FILES)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    _check_lengths(model, settings)
    result = analyze(model, tokenizer, texts, settings, out, model_name=args.model,
                     progress=not args.no_progress, checkpoint=lambda r: save_json(r, out / "analysis.json"))
    result["seconds"]["total"] = round(time.perf_counter() - start, 1)
    result["text"] = args.text or "shakespeare"
    save_json(result, out / "analysis.json")
    _write_reports(result, out)
    print(f"results: {out / 'analysis.json'}", file=sys.stderr)
    return 0


def _check_lengths(model, settings: AnalysisSettings) -> None:
    """Every length the analysis will feed the model fits its positions (checked before any work)."""
    from scissorhands.hf.modelinfo import model_facts

    limit = model_facts(model).max_positions
    if limit is None:
        return
    lengths = [("seq-len", max(settings.seq_lens))]
    if "ppl" in settings.parts:
        lengths.append(("ppl-seq-len", settings.ppl_seq_len))
    for option, length in lengths:
        if length > limit:
            raise ValueError(f"{option}: {length} tokens exceed the model's {limit} positions; give {limit} or fewer")


def _write_reports(result: dict, out: Path) -> None:
    from .report import summary, write_plots
    from .tables import markdown

    print(summary(result))
    (out / "tables.md").write_text(markdown(result))
    for path in write_plots(result, out):
        print(f"plot: {path}", file=sys.stderr)
    print(f"tables: {out / 'tables.md'}", file=sys.stderr)


def _read_result(path: Path) -> dict:
    import json

    if not path.is_file():
        raise ValueError(f"from-json: no such file {str(path)!r}")
    try:
        result = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"from-json: {str(path)!r} is not an analysis result (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"from-json: {str(path)!r} is not valid JSON ({e.msg})") from None
    if not isinstance(result, dict) or "settings" not in result:
        raise ValueError(f"from-json: {str(path)!r} is not an analysis result")
    return result


def _redraw(result: dict, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    _write_reports(result, out)
    return 0
