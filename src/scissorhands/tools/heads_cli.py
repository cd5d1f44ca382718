"""``scissorhands heads``: rank a model's KV heads once, for head-level budgets (``--head-budgets FILE.json``).

The ranking is measured with the full cache on real text (:mod:`.heads`): by default Python source from the
standard library, or ``--text FILE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scissorhands.core.settings.heads import DEFAULT_LENGTH, DEFAULT_RECENT, STREAMING_SINKS

from .cliargs import add_model_args, option


def add_parser(subparsers) -> None:
    """Add the ``heads`` subcommand."""
    p = subparsers.add_parser("heads", allow_abbrev=False,
                              help="rank the model's KV heads by how far back they look, for --head-budgets")
    add_model_args(p)
    p.add_argument("--text", type=Path, default=None,
                   help="calibration text (default: the Python standard library's inspect.py; not your test data)")
    option(p, "--tokens", int, 2048, "tokens of the text to run through the model")
    option(p, "--length", int, DEFAULT_LENGTH, "tokens run at once (their attention probabilities are held)")
    option(p, "--sinks", int, STREAMING_SINKS, "first tokens a streaming head keeps, while measured")
    option(p, "--recent", int, DEFAULT_RECENT, "recent tokens a streaming head keeps, while measured")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")


def run(args, check_model_args) -> int:
    """Measure and write the ranking; bad input is a one-line ``ValueError`` naming the option."""
    from .paths import check_apart, check_output_folder

    for name, low in (("tokens", 2), ("length", 2), ("sinks", 0), ("recent", 1)):
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"{name}: must be >= {low}, got {value}")
    if args.sinks + args.recent >= min(args.length, args.tokens):
        raise ValueError(f"recent: sinks + recent ({args.sinks + args.recent}) must be < --length and --tokens, so "
                         "that some query looks past them")
    check_model_args(args)
    if args.out.suffix != ".json":
        raise ValueError(f"out: must be a .json file, got {str(args.out)!r}")
    if args.out.is_dir():
        raise ValueError(f"out: {str(args.out)!r} is a folder; give a .json file name")
    if args.text is not None:
        from .text import load_texts

        if not args.text.expanduser().is_file():
            raise ValueError(f"text: no such file {str(args.text)!r}")
        check_apart({"out": [args.out]}, {"text": args.text})
        text_name, text = str(args.text), "\n\n".join(t for _, t in load_texts(str(args.text), "text"))
    else:
        from .heads import default_text

        text_name, text = default_text()
    check_output_folder(args.out.parent, "out", (args.out.name,))  # probed with a real file, nothing created

    from .heads import measure_heads
    from .models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = tokenizer(text, add_special_tokens=False).input_ids[: args.tokens]
    if len(ids) <= args.sinks + args.recent:
        raise ValueError(f"text: {len(ids)} tokens, fewer than sinks + recent + 1 ({args.sinks + args.recent + 1})")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and args.length > limit:
        raise ValueError(f"length: {args.length} exceeds the model's {limit} positions")
    ranking = measure_heads(model, ids, name=args.model, text=text_name, sinks=args.sinks, recent=args.recent,
                            length=args.length)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ranking.save(args.out)
    flat = sorted(((s, layer, h) for layer, row in zip(ranking.layers, ranking.scores) for h, s in enumerate(row)),
                  reverse=True)
    top = ", ".join(f"layer {layer} head {h} ({s:.2f})" for s, layer, h in flat[:3])
    print(f"{len(flat)} KV heads of {len(ranking.layers)} layers ranked on {ranking.tokens} tokens of {text_name}; "
          f"furthest-looking: {top}: {args.out}", file=sys.stderr)
    return 0
