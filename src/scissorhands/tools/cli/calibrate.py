"""``scissorhands calibrate``: per-channel key centres for packed K/V, measured on a calibration text."""

from __future__ import annotations

import sys

from ..paths import check_apart
from .checks import check_model_args, check_range


def run(args) -> int:
    from ..calibrate import measure_key_centers, save_key_centers
    from ..models import load_model
    from ..text import load_texts

    check_range("tokens", args.tokens, 2)
    check_model_args(args)
    if not args.text.expanduser().is_file():
        raise ValueError(f"text: no such file {str(args.text)!r}")
    text = "\n\n".join(t for _, t in load_texts(str(args.text), "text"))
    if args.out.suffix != ".json":
        raise ValueError(f"out: must be a .json file, got {str(args.out)!r}")
    check_apart({"out": [args.out]}, {"text": args.text})
    if args.out.is_dir():
        raise ValueError(f"out: {str(args.out)!r} is a folder; give a .json file name")
    from ..paths import check_output_folder

    check_output_folder(args.out.parent, "out", (args.out.name,))  # probed with a real file, nothing created
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    from scissorhands.hf.modelinfo import model_facts

    limit = model_facts(model).max_positions
    if limit is not None and args.tokens > limit:
        raise ValueError(f"tokens: {args.tokens} exceeds the model's {limit} positions; give --tokens {limit} or "
                         "fewer")
    record = measure_key_centers(model, tokenizer, text, args.tokens,
                                 {"auto": None, "rotary": True, "fixed": False}[args.frame])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_key_centers(record, args.out)
    print(f"key centres of {len(record['layers'])} layers from {record['tokens']} tokens: {args.out}",
          file=sys.stderr)
    return 0
