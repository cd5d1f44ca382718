"""The plugin's three compiled operators over vLLM's CPU K/V, and their torch references.

:func:`decode` attends every decoding request's new query over its window (the
logical positions ``(p - B, p]``) and adds the probabilities to the importance
accumulator of each slot, per KV head, summed over the group's query heads
(``sum`` and ``mean``) or counted where they exceed ``1/n`` (``count``). The
accumulator is kept per *physical* slot of vLLM's cache,
``acc[bucket, block, kv_head, offset]``, so the step reads K and V where they
lie, block by block, with no gather and no copy, and writes where the token
lives.

:func:`prompt` attends a prompt once, exactly, and records in the same pass
what the core's prompt-aware prefill records: each query's shares in its
bucket's accumulator and the last queries' snapshot. Per KV head and tile of
queries it is one ``Q K^T`` product, one pass over the rows (softmax and the
column sums), one ``P V`` product.

:func:`rounds` runs one step's rounds for every layer: each rounding row's
victims per KV head (the core's selection over the method's scores) and their
swap into the window's leaving slots, K/V, positions and importance together.

They are C++ (``csrc/``: one file each and a shared header, built as one
module by ``torch.utils.cpp_extension``), built for the machine they run
on and cached by torch in ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``): at start-up by the plugin's worker, or ahead by
``scissorhands build`` (:mod:`.build`: a stale lock, a missing compiler or an
unwritable folder is one line).
:func:`decode_reference`, :func:`prompt_reference` and
``rounds.move_victims_reference`` are the same in plain torch: the tests hold
each pair equal.

Why by hand: vLLM's CPU kernels and torch's fused attention return no
probabilities, and no library operator computes a softmax over paged blocks in
place, or column sums of a causal softmax without writing the ``T x T``
matrix; reading each key once, where it lies, is what makes the step cheap.
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import torch

from .build import load as load_extension
from .build import module_file as build_module_file

#: The operators' C++ (package data beside this module): the shared header, then one file per operator.
CSRC = Path(__file__).resolve().parent / "csrc"
_FILES = ("common.hpp", "decode.cpp", "prompt.cpp", "rounds.cpp")


def _sources() -> dict[str, str]:
    return {name: (CSRC / name).read_text() for name in _FILES}


#: Built for the machine it runs on (there, at start-up or ahead). Fast maths lets the compiler vectorise the
#: softmax's exponentials with glibc's vector maths; the operator reads no slot outside a window and starts each
#: maximum from a real logit, so it meets no infinity or NaN.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_FUNCTIONS = ["decode", "prompt", "rounds"]
_OPS: dict = {}
#: Layout codes of the operator: vLLM's CPU kernels "vec" and "vec16" hold K transposed per block, "amx" in tiles.
LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}
#: vLLM's 8-bit K/V formats (``kv_cache_dtype``): bytes in the layouts above, read through a table, times a scale.
FP8 = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
_FP8_TYPES = {1: torch.float8_e4m3fn, 2: torch.float8_e5m2}


def _machine() -> str:
    """What ``-march=native`` builds for: the CPU's model and flags (a cached build is per machine)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    return "".join(line for line in text.splitlines(True) if line.startswith(("model name", "flags")))[:4096]


def operator_name() -> str:
    """The operator's extension name: one build per source, flags, torch build and CPU, so environments with the
    same torch share it (torch's extension folder is per Python version already)."""
    sources = "".join(f"{name}\n{text}" for name, text in _sources().items())
    key = hashlib.sha256((sources + " ".join(_CFLAGS) + torch.__version__ + _machine()).encode())
    return f"scissorhands_paged_{key.hexdigest()[:12]}"


def operator_file():
    """Where the built operator lies (or will): ``TORCH_EXTENSIONS_DIR``/name/name.so."""
    return build_module_file(operator_name())


def _ops():
    """The compiled operator, loaded or built (:func:`.build.load`) once per process."""
    if "ops" not in _OPS:
        # One translation unit: the operators' files in order, each finding the header through -I.
        source = "\n".join(text for name, text in _sources().items() if name.endswith(".cpp"))
        _OPS["ops"] = load_extension(operator_name(), source, _FUNCTIONS, [*_CFLAGS, f"-I{CSRC}"], ["-lmvec"])
    return _OPS["ops"]


def build():
    """Build (or load) the operator now, before serving; a :class:`.build.BuildError` of one line if it cannot be.
    Returns the loaded module."""
    return _ops()


_NONE = torch.empty(0)
_HELD = torch.empty(0, dtype=torch.int64)


def decode(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
           softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0, held: torch.Tensor | None = None) -> None:
    """Attend each decoding request's new query over its window, and add its probabilities to ``acc``, in place.

    query (T, H_q, D) the step's queries; kv_cache (num_blocks, H_kv, N, 2D) vLLM's CPU cache in ``layout``
    ("vec"/"vec16": K transposed in each block; "amx": vLLM's AMX tiles, 2-byte types); tok (R,) each request's
    token index in ``query``; last (R,) its position ``p``; tables (R, blocks) int32 its block-table row; bucket
    (R,) the ring slot its step adds to; restart (R,) bool, whether that slot starts a new bucket (zeroed over
    the window first); budget: the window ``B``, the logical slots ``(p - B, p]``. ``acc`` (NB, num_blocks,
    H_kv, N) float32, or None for a method with no importance; the new token's own slot (position ``p``) is
    zeroed before it is added to: a fresh token has no history. ``out`` (R, H_q, D) float32 receives the
    attention output, or None (the importance only). ``fp8``: vLLM's 8-bit format of a uint8 cache ("fp8",
    "fp8_e4m3", "fp8_e5m2"), whose values are ``k_scale`` (keys) and ``v_scale`` (values) times the bytes' own.
    ``held`` (R,) int64, or None: each request's held prompt (``prefill="keep-prompt"``), the positions
    ``[0, P)`` it attends beside its window, which then starts no earlier than ``P``: ``[max(P, p - B + 1), p]``.
    """
    _ops().decode(query.float().contiguous(), kv_cache, tok, last, tables.contiguous(), bucket, restart,
                  _NONE if acc is None else acc, _NONE if out is None else out, budget,
                  _HELD if held is None else held.to(torch.int64).contiguous(), float(scale),
                  float(softcap or 0.0), bool(count), acc is not None, out is not None, LAYOUTS[layout],
                  FP8[fp8] if fp8 else 0, float(k_scale), float(v_scale))


def observe(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
            softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0, held: torch.Tensor | None = None) -> None:
    """:func:`decode`'s importance update alone (no output)."""
    decode(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count, layout,
           fp8, k_scale, v_scale, held)


def prompt(q, k, v, out, acc, snap, scale: float, softcap: float | None, count: bool, bucket_steps: int | None,
           observe_from: int, tile: int = 64) -> None:
    """Attend a prompt once, exactly and causally, and record its importance and snapshot in the same pass.

    q (H_kv, g, T_q, D): the prompt's last ``T_q`` queries (``T_q <= T``: the caller may attend the first ones by
    other means), k and v (H_kv, T, D), float32 and contiguous; ``out`` (T_q, H_kv * g, D) float32 receives
    their output. ``acc`` (NB, H_kv, T) float32 (only with every query, ``T_q == T``) receives what the core's
    importance state holds after observing every query (query ``i``'s shares, summed over its group's heads or
    counted above ``1/(i+1)``, in bucket ``(i // bucket_steps) % NB``; buckets restarted by later ones hold only
    their latest queries), or None.
    ``snap`` (H_kv, T) float32 receives the shares of the queries at positions ``observe_from..T-1`` (the
    prompt-aware prefill's snapshot; ``observe_from >= T - T_q``), or None. ``tile``: queries per product.
    """
    nb = 1 if acc is None else acc.shape[0]
    _ops().prompt(q, k, v, out, _NONE if acc is None else acc, _NONE if snap is None else snap, float(scale),
                  float(softcap or 0.0), bool(count), int(bucket_steps or 0), nb, int(observe_from), int(tile),
                  acc is not None, snap is not None)


def rounds(kv_caches: list, layout: str, pos, acc, window, scores, order, shield, recent: int, drop: int) -> None:
    """One step's rounds for every layer in one call: per (layer, rounding row, KV head), the ``drop`` lowest-scoring
    tokens of the window (the core's ``selection.lowest``: the last ``recent`` and ``shield``-ed ones never, the
    older of equal scores first) swapped into the window's ``drop`` leaving slots, oldest victim first, and the kept
    tokens found there into the victims' slots; K/V, positions and importance move together, in place.

    kv_caches: the L layers' (num_blocks, H_kv, N, 2D) caches in ``layout`` (one shape and dtype; fp8 as bytes);
    pos (L, num_blocks * N, H_kv) int32; acc (L, NB, num_blocks, H_kv, N) float32 or None; window (Rr, B) the
    rounding rows' physical slots, oldest first; scores (L * Rr, H_kv, B) in position order (compared in float64,
    as the torch selection compares them, NaN included: last, or first where one victim is chosen); order (L * Rr,
    H_kv, B) the logical slot (index into ``window``) of each; shield (L * Rr, H_kv, B) bool, or None.
    """
    rows = scores.shape
    _ops().rounds(list(kv_caches), LAYOUTS[layout], pos, _NONE if acc is None else acc, acc is not None,
                  window.long().contiguous(), scores.double().contiguous(), order.long().contiguous(),
                  _NONE if shield is None else shield.expand(rows).contiguous(), shield is not None, int(recent),
                  int(drop))


def prompt_reference(q, k, v, out, acc, snap, scale: float, softcap: float | None, count: bool,
                     bucket_steps: int | None, observe_from: int, tile: int = 64) -> None:
    """:func:`prompt` in plain torch over the whole ``T_q x T`` matrix (the tests' reference)."""
    h, g, tq, d = q.shape
    t = k.shape[1]
    assert acc is None or tq == t, "acc: every query's shares, so every query"
    logits = torch.einsum("hgid,hjd->hgij", q.double(), k.double()) * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    causal = torch.arange(t)[None, :] <= torch.arange(t - tq, t)[:, None]  # (i, j): the query at t - tq + i
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)  # (H, g, T_q, T)
    out.copy_(torch.einsum("hgij,hjd->ihgd", probs, v.double()).reshape(tq, h * g, d).float())
    if acc is not None:
        if count:
            contrib = (probs > 1.0 / torch.arange(1, t + 1, dtype=torch.float64)[:, None]).double().sum(1)
        else:
            contrib = probs.sum(1)  # (H, i, j)
        acc.zero_()
        steps = bucket_steps or t
        for i in range(t):  # each query in turn, as the core's state sees them: a bucket restarts at its first step
            slot = (i // steps) % acc.shape[0]
            if bucket_steps and i % bucket_steps == 0:
                acc[slot] = 0
            acc[slot] += contrib[:, i].float()
    if snap is not None:
        snap.copy_(probs[:, :, observe_from - (t - tq):].sum(dim=(1, 2)).float())


def dequantize(x: torch.Tensor, fp8: str | None, scale: float = 1.0) -> torch.Tensor:
    """Stored K or V elements as float32: vLLM's fp8 bytes (``fp8``: their format) times ``scale``, others as
    they are."""
    if not fp8:
        return x.float()
    return x.view(_FP8_TYPES[FP8[fp8]]).float() * scale


def quantize(x: torch.Tensor, fp8: str, scale: float = 1.0) -> torch.Tensor:
    """Float K or V as vLLM's fp8 bytes (round to nearest: vLLM's own update may round the other way; tests)."""
    return (x.float() / scale).to(_FP8_TYPES[FP8[fp8]]).view(torch.uint8)


def keys_values(kv_cache: torch.Tensor, layout: str = "vec", fp8: str | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as (num_blocks, H_kv, N, D) float32 copies, whatever the layout (the references read these)."""
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    region = kv_cache.view(nb, h, 2, n * d)
    if LAYOUTS[layout] == 0:
        k, v = region[:, :, 0].view(nb, h, d, n).transpose(2, 3), region[:, :, 1].view(nb, h, n, d)
    else:
        k = region[:, :, 0].view(nb, h, n // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(nb, h, n, d)
        v = region[:, :, 1].view(nb, h, d // 16, n // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(nb, h, n, d)
    return dequantize(k.contiguous(), fp8, k_scale), dequantize(v.contiguous(), fp8, v_scale)


def decode_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
                     softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0, held: torch.Tensor | None = None) -> None:
    """:func:`decode` in plain torch, one request at a time (the tests' reference)."""
    keys, values = keys_values(kv_cache, layout, fp8, k_scale, v_scale)
    nb, h, n, d = keys.shape
    g = query.shape[1] // h
    for r in range(tok.shape[0]):
        p = int(last[r])
        kept = 0 if held is None else int(held[r])
        x = torch.cat([torch.arange(kept), torch.arange(max(kept, p - budget + 1), p + 1)])
        blocks, offs = tables[r].long()[x // n], x % n
        k, v = keys[blocks, :, offs], values[blocks, :, offs]  # (L, H_kv, D)
        q = query[int(tok[r])].float().view(h, g, d)
        logits = torch.einsum("hgd,lhd->hgl", q, k) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        probs = logits.softmax(-1)
        if out is not None:
            out[r] = torch.einsum("hgl,lhd->hgd", probs, v).reshape(h * g, d)
        if acc is None:
            continue
        contrib = (probs > 1.0 / len(x)).float().sum(1) if count else probs.sum(1)  # (H_kv, L)
        ring = acc[int(bucket[r])]  # (num_blocks, H_kv, N)
        if bool(restart[r]):
            ring[blocks, :, offs] = 0
        ring[blocks[-1], :, offs[-1]] = 0
        ring[blocks, :, offs] += contrib.T


def observe_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
                      softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0, held: torch.Tensor | None = None) -> None:
    """:func:`observe` in plain torch."""
    decode_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count,
                     layout, fp8, k_scale, v_scale, held)
