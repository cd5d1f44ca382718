"""``scissorhands analyze``: persistence, power law, calibrated budgets and the bound on one model.

Options are parsed by argparse with typed converters (defaults from
:class:`.settings.AnalysisSettings`) and checked by the settings, each with one
line naming the option, before the model is loaded.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path

from ..cliargs import FLOAT, NAMES, NUMBERS, WHOLE, WHOLES, alias
from ..cliargs import option as add_option
from .settings import PARTS, AnalysisSettings

# What ``analyze`` writes into --out (checked before any work starts).
_OUTPUT_FILES = ("analysis.json", "tables.md", "persistence.png", "powerlaw.png", "bound.png", "schedule.png",
                 "calibrated_schedule.json")


def add_parser(subparsers):
    """Add the ``analyze`` subcommand: typed options whose defaults are :class:`.settings.AnalysisSettings`'s."""
    d = AnalysisSettings
    p = subparsers.add_parser("analyze", allow_abbrev=False,
                              help="persistence of importance, power law, calibrated budgets, deviation vs budget")
    opt = functools.partial(add_option, p)

    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded default), a Hugging Face id, a folder or a .gguf file")
    p.add_argument("--text", default=None, help="text file or folder (default: Shakespeare's plays)")
    opt("--seq-len", WHOLES, d.seq_lens, "comma list of lengths T for persistence; the largest is used for the "
        "maps, power law and bound", dest="seq_len")
    opt("--num-samples", WHOLE, d.windows, "text samples of --seq-len tokens for persistence and power law (not the "
        "history --window)")
    alias(p, "--windows", "--num-samples", "num_samples")
    opt("--thresholds", NUMBERS, d.thresholds, "form (a) thresholds as multiples of 1/t")
    opt("--topk", NUMBERS, tuple(round(k * 100, 6) for k in d.topk), "form (b) top sets, percent of the first half")
    opt("--calib-topk", FLOAT, round(d.calib_topk * 100, 6), "form (b) top-set percent that drives calibration")
    opt("--budget", FLOAT, d.budget, "average budget of the calibrated schedule: fraction of --ppl-seq-len (<=1) "
        "or tokens")
    opt("--weight-floor", FLOAT, d.weight_floor, "added to each layer's weight 1 - persistence")
    opt("--ratios", NUMBERS, d.ratios, "B/T values for the bound analysis")
    opt("--bound-samples", WHOLE, d.bound_windows, "text samples for the bound analysis")
    alias(p, "--bound-windows", "--bound-samples", "bound_samples")
    opt("--ppl-seq-len", WHOLE, d.ppl_seq_len, "window length for the schedule perplexity comparison")
    opt("--ppl-samples", WHOLE, d.ppl_windows, "text samples for the schedule perplexity comparison")
    alias(p, "--ppl-windows", "--ppl-samples", "ppl_samples")
    opt("--compressions", NUMBERS, d.compressions, "compression factors T/budget for the comparison")
    opt("--calib-fraction", FLOAT, d.calib_fraction, "share of the corpus tokens (from the start) used for "
        "calibration; the rest evaluates")
    opt("--rank-lo", WHOLE, d.rank_lo, "first rank of the power-law fit (the last is T/2)")
    p.add_argument("--parts", type=NAMES, default=PARTS, help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--bos", action="store_true", help="start every window with the tokenizer's BOS token")
    opt("--seed", WHOLE, d.seed, "seed of the randomly initialised control model")
    p.add_argument("--out", default="analysis-out", help="output folder for JSON and PNG files")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--from-json", default=None,
                   help="measure nothing: redraw plots and tables into --out from an earlier analysis.json")
    return p


def settings_from_args(args) -> AnalysisSettings:
    """Build validated settings from the parsed options (raises ValueError naming the option)."""
    topk = tuple(k / 100 for k in args.topk)
    for k in topk:
        if not math.isfinite(k) or not 0.0 < k <= 1.0:
            raise ValueError(f"topk: must be in (0, 100] percent, got {k * 100:g}")
    calib = args.calib_topk / 100
    if not any(abs(calib - k) < 1e-12 for k in topk):
        raise ValueError(f"calib-topk: must be one of --topk ({','.join(f'{k:g}' for k in args.topk)}), got "
                         f"{args.calib_topk:g}")
    calib = next(k for k in topk if abs(calib - k) < 1e-12)
    for option in ("thresholds", "ratios", "compressions"):
        if not all(math.isfinite(v) for v in getattr(args, option)):
            raise ValueError(f"{option}: must be finite numbers")
    return AnalysisSettings(
        seq_lens=args.seq_len, windows=args.num_samples, thresholds=args.thresholds, topk=topk, calib_topk=calib,
        budget=args.budget, weight_floor=args.weight_floor, ratios=args.ratios, bound_windows=args.bound_samples,
        ppl_seq_len=args.ppl_seq_len, ppl_windows=args.ppl_samples, compressions=args.compressions,
        calib_fraction=args.calib_fraction, rank_lo=args.rank_lo, seed=args.seed, bos=bool(args.bos),
        parts=args.parts,
    )


def run(args) -> int:
    """Run ``scissorhands analyze``; writes ``analysis.json``, the calibrated schedule and plots to ``--out``."""
    from ..models import load_model
    from ..paths import check_apart, check_output_folder
    from ..text import load_texts
    from .pipeline import analyze
    from .report import save_json

    if args.from_json is not None:
        result = _read_result(Path(args.from_json))
        out = check_output_folder(args.out, "out", _OUTPUT_FILES)
        redrawn = [f for f in _OUTPUT_FILES if f != "analysis.json"]  # a redraw reads analysis.json, never writes it
        check_apart({"out": [out / f for f in redrawn]}, {"from-json": args.from_json})
        return _redraw(result, out)
    settings = settings_from_args(args)  # check every option before the slow model load
    if args.text is not None and args.text != "shakespeare" and not Path(args.text).expanduser().exists():
        raise ValueError(f"text: no such file or folder {args.text!r}")
    texts = load_texts(args.text, "text")
    if not str(args.model).strip():
        raise ValueError("model: is empty")
    out = check_output_folder(args.out, "out", _OUTPUT_FILES)
    check_apart({"out": [out / f for f in _OUTPUT_FILES]}, {"text": args.text})
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
