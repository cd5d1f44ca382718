"""Parity of the budgeted cache on an accelerator against the CPU, on tiny random models from configs.

    python experiments/device_check.py --device cuda --out device_check.json

For each architecture and cache setting it runs the same work on the CPU and on ``--device``:

* **batch decoding**: a left-padded batch is prefilled through the cache, then a fixed continuation is fed
  one token at a time (teacher-forced, so the two devices cannot drift apart through a near-tie in
  greedy choice), and every step's log-probabilities are compared;
* **the exact scorer** against token-by-token decoding, both on the device (the library's exactness
  promise, where it runs);
* the budget and the recent window hold on the device, and the kept positions agree with the CPU's
  (reported: on a near-tie in importance the two devices may keep different tokens).

Matrix products run in full float32 on both sides (TF32 off). Exit status 1 when any case raises or
differs beyond ``--atol``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import left_padded, tiny_model
from scissorhands import CacheSettings, EvictionAudit, ScissorhandsCache, ScissorhandsConfig
from scissorhands.core.methods import get_method
from scissorhands.hf.scoring import ScoreSetup, token_logprobs

SETTINGS = {
    "defaults": {},
    "paper": {"preset": "paper"},
    "prompt-aware": {"prefill": "prompt-aware", "observe": 4},
    "packed 8/4, tiles of 5": {"kv_bits": 4, "kv_key_bits": 8, "kv_group_size": 8, "kv_tile": 5, "kv_residual": 0},
    "merge + sinks": {"merge": True, "sinks": 2},
    "packed 4-bit, centred keys": {"kv_bits": 4, "kv_group_size": 8, "kv_key_centers": "CENTRES"},
}


def centres_for(model, arch: str) -> str:
    """Key centres of a tiny model, measured on the CPU, in a temporary file."""
    import tempfile

    from scissorhands.tools.calibrate import measure_key_centers, save_key_centers

    path = Path(tempfile.gettempdir()) / f"device_check_centres_{arch}.json"
    record = measure_key_centers(model, lambda t: {"input_ids": [3 + b % 250 for b in t.encode()]},
                                 "calibration prose for the tiny model " * 10, tokens=200)
    save_key_centers(record, path)
    return str(path)


def decode_batch(model, device, config: ScissorhandsConfig, protect=None, audit=False):
    """Log-probs (B, steps, V) of a left-padded batch prefilled, then fed a fixed continuation token by token."""
    ids, mask = left_padded([30, 12, 21], seed=3)
    extra = torch.randint(3, 256, (ids.shape[0], 12), generator=torch.Generator().manual_seed(7))
    model = model.to(device)
    cache = ScissorhandsCache(model, config, protect=protect, audit=EvictionAudit() if audit else None)
    ids, mask, extra = ids.to(device), mask.to(device), extra.to(device)
    out = []
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
        out.append(torch.log_softmax(logits.float(), -1))
        for t in range(extra.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(extra[:, t:t + 1], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
            out.append(torch.log_softmax(logits.float(), -1))
    kept = [[layer.stored_positions(b).cpu() for b in range(ids.shape[0])] for layer in cache.budgeted_layers]
    report = cache.memory_report()
    return torch.stack(out, 1).cpu(), kept, report, cache


def scorer(model, device, settings: CacheSettings, decode: bool):
    """The exact scorer's log-probs on ``device``, and (``decode``) their distance to token-by-token decoding."""
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(1)).to(device)
    model = model.to(device)
    fast, _ = token_logprobs(model, ids, ScoreSetup(get_method("scissorhands"), 16, settings))
    if not decode:
        return fast.cpu(), None
    cache = ScoreSetup(get_method("scissorhands"), 16, settings).make_cache(model, ids.shape[-1])
    slow = []
    with torch.no_grad():
        for t in range(ids.shape[-1] - 1):
            logits = model(ids[None, t:t + 1], cache=cache).logits[0, -1]
            slow.append(torch.log_softmax(logits.float(), -1)[ids[t + 1]])
    return fast.cpu(), float((fast.cpu() - torch.stack(slow).cpu()).abs().max())


def check(arch: str, name: str, extra: dict, device: torch.device, atol: float) -> dict:
    model = tiny_model(arch)
    if extra.get("kv_key_centers") == "CENTRES":
        extra = {**extra, "kv_key_centers": centres_for(model.to("cpu"), arch)}
    config = ScissorhandsConfig(budget=16, recent=4, **extra)
    protect = [(0, 3)] if name == "merge + sinks" else None
    row: dict = {"arch": arch, "setting": name}
    start = time.perf_counter()
    cpu, kept_cpu, _, _ = decode_batch(model, torch.device("cpu"), config, protect)
    dev, kept_dev, report, cache = decode_batch(model, device, config, protect, audit=True)
    row["max_abs_logprob_diff"] = float((cpu - dev).abs().max())
    row["kept_sets_equal"] = sum(bool(torch.equal(torch.sort(a, -1).values, torch.sort(b, -1).values))
                                 for la, lb in zip(kept_cpu, kept_dev) for a, b in zip(la, lb))
    row["kept_sets_total"] = sum(len(la) for la in kept_cpu)
    # The prompt-aware prefill holds a whole prompt once by design; from then on the budget holds.
    streamed = extra.get("prefill", "stream") == "stream"
    row["peak_stored"] = report["peak_stored"]
    row["budget_held"] = (report["peak_stored"] if streamed else report["max_stored"]) <= 16
    recent_ok = True
    for layer in cache.budgeted_layers:
        for b in range(3):
            pos = layer.stored_positions(b)  # (H_kv, L)
            seen = int(layer.kv.slots.seen[b])
            want = torch.arange(max(0, seen - layer.kv.recent), seen, device=pos.device)
            recent_ok &= all(bool(torch.isin(want, pos[h]).all()) for h in range(pos.shape[0]))
    row["recent_kept"] = recent_ok
    settings = CacheSettings(recent=4, **extra)
    on_cpu, _ = scorer(model, torch.device("cpu"), settings, False)
    on_dev, gap = scorer(model, device, settings, streamed)  # prompt-aware scoring is not decoding, by design
    row["scorer_cpu_vs_device"] = float((on_cpu - on_dev).abs().max())
    row["scorer_vs_decoding_on_device"] = gap
    row["seconds"] = time.perf_counter() - start
    row["ok"] = (row["max_abs_logprob_diff"] <= atol and row["budget_held"] and recent_ok
                 and row["scorer_cpu_vs_device"] <= atol and (gap is None or gap <= atol))
    model.to("cpu")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--archs", default="llama,qwen2,gemma3,mistral")
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from scissorhands.tools.models import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for arch in args.archs.split(","):
        for name, extra in SETTINGS.items():
            try:
                row = check(arch, name, extra, device, args.atol)
            except Exception as e:  # a failure is a finding: record it and go on
                row = {"arch": arch, "setting": name, "ok": False, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} cases agree with the CPU on {device}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
