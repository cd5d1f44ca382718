"""Checks of the command line's own options, each a one-line ``ValueError`` naming the option, made before anything
slow is loaded."""

from __future__ import annotations

import math

from ..paths import check_apart

MAX_SEED = 2**63 - 1


def check_range(name: str, value, low, high=None, low_open: bool = False) -> None:
    """One-line ``ValueError`` naming ``name`` unless ``value`` is finite and within [low, high] (or (low, high])."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value}")
    if (value <= low) if low_open else (value < low):
        raise ValueError(f"{name}: must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: must be <= {high}, got {value}")


def check_generation_args(args) -> None:
    """The generation options of ``generate`` and ``demo``, before anything is loaded."""
    check_range("max-new-tokens", args.max_new_tokens, 1)
    check_range("temperature", args.temperature, 0, low_open=True)
    check_range("top-p", args.top_p, 0, 1, low_open=True)
    check_range("seed", args.seed, 0, MAX_SEED)


def check_trust_args(args) -> None:
    """The protection and audit options, before anything is loaded."""
    if args.protect_prefix is not None:
        check_range("protect-prefix", args.protect_prefix, 1)
    if args.protect_system and args.system is None:
        raise ValueError("protect-system: needs --system (the system prompt to pin)")
    if args.system is not None and not args.system.strip():
        raise ValueError("system: is empty")
    if args.audit_events and args.audit is None:
        raise ValueError("audit-events: needs --audit OUT.json")
    if args.audit is not None:
        parent = args.audit.resolve().parent
        if not parent.is_dir():
            raise ValueError(f"audit: no such folder {str(parent)!r}")
        if args.audit.is_dir():
            raise ValueError(f"audit: {str(args.audit)!r} is a folder; give a file name")
        if args.audit.suffix.lower() == ".png":
            raise ValueError(f"audit: {str(args.audit)!r} is where the JSON goes, and its heat map is written beside "
                             "it as .png; give a .json name")
        outputs = (args.audit, args.audit.with_suffix(".png"))
        from ..paths import check_output_folder

        # Probed with a real file, as for --out: permission bits do not tell on a read-only mount or for root.
        check_output_folder(parent, "audit", tuple(o.name for o in outputs))
        check_apart({"audit": list(outputs)}, input_files(args))


def input_files(args) -> dict:
    """The files a command reads, by option (``check_apart`` skips values that are not files)."""
    names = ("prompt_file", "kv_key_centers", "schedule", "text", "data", "from_json")
    found = {n.replace("_", "-"): getattr(args, n, None) for n in names}
    tasks = getattr(args, "tasks", None)
    for i, t in enumerate(tasks.split(",") if isinstance(tasks, str) else []):
        found["tasks" if i == 0 else f"tasks ({t.strip()})"] = t.strip()
    return found


def check_model_args(args) -> None:
    from ..known_models import check_name

    if not str(args.model).strip():
        raise ValueError("model: is empty")
    check_name(args.model)  # a near miss of a known name fails before torch is imported
    from ..models import resolve_device, resolve_dtype

    resolve_dtype(args.dtype)
    resolve_device(args.device)
