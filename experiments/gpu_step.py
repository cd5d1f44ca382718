"""Check and time the vLLM plugin's decode step and eviction rounds as they would run on a GPU.

    python experiments/gpu_step.py --device cuda --out gpu_step.json
    TRITON_INTERPRET=1 python experiments/gpu_step.py --device cpu --quick

On CPUs the plugin attends each decoding request's new query over its window with one compiled C++ operator per
layer (:func:`scissorhands.vllm.kernels.decode`), and every ``drop`` steps a request's layer runs a round
(``PagedLayer._round``). On a GPU, vLLM keeps a layer's K/V as ``kv_cache[2, num_blocks, block_size, H_kv, D]``
(the FlashAttention backend's layout: index 0 keys, 1 values). This script holds the GPU side of both and checks
it against the project's own semantics:

* ``paged_decode``, a Triton kernel with the semantics of :func:`~scissorhands.vllm.kernels.decode_reference` on
  that layout: one program per (request, KV head) reads the window's K/V through the request's block-table row
  (logical positions ``(p - B, p]``), computes each query head's softmax (optional tanh soft cap) in two passes
  (output with an online softmax, then the normalised probabilities), writes the output, and adds each slot's
  share (summed over the group's query heads, or counted above ``1/L``) to the per-physical-slot accumulator
  ``acc[bucket, block, kv_head, offset]``, zeroing the window first on a restart and the new token's slot always;
* **decode**: the kernel against a float64 torch reference on random ragged windows (``p < B``, ``p = B - 1``,
  windows over many blocks, GQA with g = 3, head size 64, blocks of 16), float32 K/V within 1e-4 and bf16 K/V
  within 2e-2 relative, for the ``sum``, ``count`` and no-importance forms, with and without a soft cap;
* **rounds**: a few requests served through a synthetic paged cache on the device (prompts within the budget,
  attended by the core; decode steps by the kernel; rounds by batched torch ops with the core's
  :func:`~scissorhands.core.tokens.selection.lowest` on the device's tensors), each request fed alone to a one-row core
  layer in rounds on the CPU: the outputs and the positions each KV head's window holds must be the core's;
* **timings** (CUDA events, medians): the Triton step against torch's ``scaled_dot_product_attention`` over the
  same windows held contiguously, and one round over 32 rows.

The device needs PyTorch and Triton only: vLLM is not imported, and the package is imported from this checkout's
``src/``. ``--device cpu`` runs the kernel in Triton's interpreter (``TRITON_INTERPRET=1``; bf16 K/V are read
there as their bit patterns and widened in the kernel, the interpreter having no bfloat16); ``--quick`` keeps
every shape tiny. One line per check, then the JSON record; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from scissorhands.core.attend.prefill import make_prefill
from scissorhands.core.attend.streaming import attend
from scissorhands.core.methods.base import LayerView
from scissorhands.core.stores.base import DenseKVStore
from scissorhands.core.tokens.importance import ImportanceState
from scissorhands.core.tokens.selection import lowest
from scissorhands.vllm.paged import PagedLayer
from scissorhands.vllm.planner import Planner, StepPlan
from scissorhands.vllm.rounds import _Slots
from scissorhands.vllm.settings import PluginSettings, parse

try:
    import triton
    import triton.language as tl
except ImportError:  # --help and the torch reference need no Triton
    triton = tl = None

#: Triton's interpreter runs the kernels on the CPU (read when ``triton.jit`` decorates them, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: The plugin settings served in the rounds check (tests/vllm/test_paged_layer.py's, all of which the device runs).
PLUGINS = {
    "defaults": {"budget": 12},
    "drop4": {"budget": 12, "drop": 4},
    "paper": {"budget": 12, "preset": "paper"},
    "h2o": {"budget": 12, "method": "h2o", "recent": 2, "drop": 3},
    "tova": {"budget": 12, "method": "tova"},
    "streaming": {"budget": 12, "method": "streaming", "drop": 2},
    "protected": {"budget": 11, "protect_prefix": 3, "recent": 2, "drop": 3},
    "count-buckets": {"budget": 12, "importance": "count", "window": 6, "window_buckets": 3, "drop": 3},
}
#: What ``--quick`` serves: each path once (sums, none, shields, counts in buckets).
QUICK = ("defaults", "h2o", "streaming", "protected", "count-buckets")
#: Windows over several blocks (full runs only).
WIDE = {
    "defaults-b48": {"budget": 48},
    "h2o-b48": {"budget": 48, "method": "h2o", "recent": 8, "drop": 6},
}

if triton is not None:

    @triton.jit
    def _load_f32(ptrs, mask, BITS16: tl.constexpr):
        """K or V as float32; ``BITS16``: bf16 given as its int16 bit patterns (the interpreter has no bf16)."""
        if BITS16:
            x = (tl.load(ptrs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _logits(q, k, softcap, SOFTCAP: tl.constexpr):
        """(G_PAD, TILE) logits of the scaled queries q (G_PAD, D) over keys k (TILE, D), soft-capped."""
        logit = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if SOFTCAP:  # tanh(l / c) * c, through exp (overflow gives c)
            logit = softcap - 2.0 * softcap / (tl.exp(2.0 * logit / softcap) + 1.0)
        return logit

    @triton.jit
    def _paged_decode_kernel(q_ptr, kv_ptr, tok_ptr, last_ptr, tab_ptr, bucket_ptr, restart_ptr, acc_ptr, out_ptr,
                             budget, scale, softcap, sq_t, sq_h, skv_kv, skv_b, skv_n, skv_h, s_tab, n_blocks,
                             H: tl.constexpr, N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                             G_PAD: tl.constexpr, TILE: tl.constexpr, SOFTCAP: tl.constexpr, COUNT: tl.constexpr,
                             WANT_ACC: tl.constexpr, WANT_OUT: tl.constexpr, BITS16: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        p = tl.load(last_ptr + r).to(tl.int32)
        ws = tl.maximum(p - budget + 1, 0)  # the window: logical positions ws..p
        j = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        live = j < G  # the group's query heads (G_PAD is a power of two)
        t = tl.load(tok_ptr + r)
        q = tl.load(q_ptr + t * sq_t + (h * G + j)[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        q = q.to(tl.float32) * scale
        tab = tab_ptr + r * s_tab
        top = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], dtype=tl.float32)
        ctx = tl.zeros([G_PAD, D], dtype=tl.float32)
        # Pass 1: running maximum and sum (and the output, by an online softmax), TILE tokens at a time, each
        # token's slot through the block table.
        for x0 in range(ws, p + 1, TILE):
            x = x0 + tl.arange(0, TILE)
            inside = x <= p
            blk = tl.load(tab + x // N, mask=inside, other=0).to(tl.int64)
            row = kv_ptr + blk * skv_b + (x % N) * skv_n + h * skv_h  # (TILE,) this head's K of each token
            k = _load_f32(row[:, None] + d[None, :], inside[:, None], BITS16)
            logit = tl.where(inside[None, :], _logits(q, k, softcap, SOFTCAP), float("-inf"))
            new_top = tl.maximum(top, tl.max(logit, axis=1))
            alpha = tl.exp(top - new_top)
            e = tl.exp(logit - new_top[:, None])
            total = total * alpha + tl.sum(e, axis=1)
            if WANT_OUT:
                v = _load_f32(row[:, None] + skv_kv + d[None, :], inside[:, None], BITS16)
                ctx = ctx * alpha[:, None] + tl.sum(e[:, :, None] * v[None, :, :], axis=1)
            top = new_top
        inv = 1.0 / total
        if WANT_OUT:
            tl.store(out_ptr + (r * (H * G) + h * G + j)[:, None] * D + d[None, :], ctx * inv[:, None],
                     mask=live[:, None])
        if WANT_ACC:
            # Pass 2: the normalised probabilities, summed over the group (or counted above 1/L), into each slot.
            bucket = tl.load(bucket_ptr + r).to(tl.int64)
            restart = tl.load(restart_ptr + r) != 0
            thr = 1.0 / (p - ws + 1).to(tl.float32)
            ring = acc_ptr + (bucket * n_blocks * H + h) * N  # acc[bucket, 0, h, 0]
            for x0 in range(ws, p + 1, TILE):
                x = x0 + tl.arange(0, TILE)
                inside = x <= p
                blk = tl.load(tab + x // N, mask=inside, other=0).to(tl.int64)
                row = kv_ptr + blk * skv_b + (x % N) * skv_n + h * skv_h
                k = _load_f32(row[:, None] + d[None, :], inside[:, None], BITS16)
                logit = tl.where(inside[None, :], _logits(q, k, softcap, SOFTCAP), float("-inf"))
                prob = tl.exp(logit - top[:, None]) * inv[:, None]
                if COUNT:
                    share = tl.where(live[:, None] & (prob > thr), 1.0, 0.0)
                else:
                    share = tl.where(live[:, None], prob, 0.0)
                slot = ring + blk * (H * N) + x % N
                held = tl.load(slot, mask=inside, other=0.0)
                held = tl.where(restart | (x == p), 0.0, held)  # a bucket that starts now; the new token's slot
                tl.store(slot, held + tl.sum(share, axis=0), mask=inside)


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, tok: torch.Tensor, last: torch.Tensor,
                 tables: torch.Tensor, bucket: torch.Tensor, restart: torch.Tensor, acc: torch.Tensor | None,
                 out: torch.Tensor | None, budget: int, scale: float, softcap: float | None, count: bool,
                 tile: int = 32, num_warps: int = 4) -> None:
    """Attend each decoding request's new query over its window and add its probabilities to ``acc``, in place.

    Parameters
    ----------
    query : Tensor, shape (T, H_q, D)
        The step's queries (any float dtype).
    kv_cache : Tensor, shape (2, num_blocks, N, H_kv, D)
        vLLM's GPU layout: keys, then values.
    tok, last : LongTensor, shape (R,)
        Each request's row in ``query`` and its position ``p``.
    tables : IntTensor, shape (R, blocks)
        Each request's block-table row.
    bucket : LongTensor, shape (R,)
        The ring slot its step adds to.
    restart : Tensor, shape (R,), bool or int32
        Whether that ring slot starts a new bucket (zeroed over the window first).
    acc : Tensor, shape (NB, num_blocks, H_kv, N), float32, or None
        The importance per physical slot; None for a method with no importance.
    out : Tensor, shape (R, H_q, D), float32, or None
        Receives the attention output.
    budget : int
        The window ``B``: logical positions ``(p - B, p]``.
    scale, softcap : float
        Logit scale, and the soft cap (None or 0 for none).
    count : bool
        Count probabilities above ``1/L`` instead of summing them.
    tile, num_warps : int
        Tokens per iteration (a power of two) and warps per program.
    """
    r = tok.shape[0]
    _, nb, n, h, d = kv_cache.shape
    if r == 0:
        return
    assert kv_cache.stride(-1) == 1 and query.stride(-1) == 1 and tables.dtype == torch.int32
    assert acc is None or (acc.is_contiguous() and acc.dtype == torch.float32 and tuple(acc.shape[1:]) == (nb, h, n))
    assert out is None or (out.is_contiguous() and out.dtype == torch.float32)
    bits16 = INTERPRET and kv_cache.dtype == torch.bfloat16
    kv = kv_cache.view(torch.int16) if bits16 else kv_cache
    if INTERPRET and query.dtype == torch.bfloat16:
        query = query.float()  # exact
    if restart.dtype == torch.bool:
        restart = restart.to(torch.int32)
    g = query.shape[1] // h
    spare = torch.empty(1, dtype=torch.float32, device=kv_cache.device)
    _paged_decode_kernel[(r, h)](
        query, kv, tok, last, tables, bucket, restart, spare if acc is None else acc, spare if out is None else out,
        int(budget), float(scale), float(softcap or 1.0), query.stride(0), query.stride(1), kv.stride(0),
        kv.stride(1), kv.stride(2), kv.stride(3), tables.stride(0), nb, H=h, N=n, D=d, G=g,
        G_PAD=triton.next_power_of_2(g), TILE=tile, SOFTCAP=bool(softcap), COUNT=bool(count),
        WANT_ACC=acc is not None, WANT_OUT=out is not None, BITS16=bits16, num_warps=num_warps)


def decode_torch(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
                 softcap: float | None, count: bool) -> torch.Tensor | None:
    """:func:`paged_decode` in plain torch (float64), one request at a time, gathering each window.

    Returns the slots of ``acc`` where a count sits at its threshold within rounding (some query head's
    probability within 1e-4 relative of ``1/L``: a float32 kernel may count it either way), or None.
    """
    keys, values = kv_cache[0].double(), kv_cache[1].double()  # (num_blocks, N, H_kv, D)
    _, n, h, d = keys.shape
    g = query.shape[1] // h
    near = None if acc is None or not count else torch.zeros_like(acc, dtype=torch.bool)
    for r in range(tok.shape[0]):
        p = int(last[r])
        x = torch.arange(max(0, p - budget + 1), p + 1, device=kv_cache.device)
        blocks, offs = tables[r].long()[x // n], x % n
        k, v = keys[blocks, offs], values[blocks, offs]  # (L, H_kv, D)
        q = query[int(tok[r])].double().view(h, g, d)
        logits = torch.einsum("hgd,lhd->hgl", q, k) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        probs = logits.softmax(-1)  # (H_kv, g, L)
        if out is not None:
            out[r] = torch.einsum("hgl,lhd->hgd", probs, v).reshape(h * g, d).float()
        if acc is None:
            continue
        contrib = (probs > 1.0 / len(x)).double().sum(1) if count else probs.sum(1)  # (H_kv, L)
        ring = acc[int(bucket[r])]  # (num_blocks, H_kv, N)
        if bool(restart[r]):
            ring[blocks, :, offs] = 0
        ring[blocks[-1], :, offs[-1]] = 0
        ring[blocks, :, offs] += contrib.T.float()
        if near is not None:
            edge = ((probs * len(x) - 1).abs() < 1e-4).any(1)  # (H_kv, L)
            near[int(bucket[r])][blocks, :, offs] |= edge.T
    return near


# -- the decode check -----------------------------------------------------------------------------------------
def check_decode(device: torch.device, quick: bool, seed: int) -> list[dict]:
    """The kernel against :func:`decode_torch` on random ragged windows, per dtype, form, soft cap and tile."""
    h, g, d, n = (2 if quick else 3), 3, 64, 16  # KV heads, group, head size, block
    budget = 40 if quick else 150
    last = [0, 5, 15, 16, budget - 1, budget, budget + 1, 60, 100] + ([] if quick else [333, 517, 1000])
    rows = len(last)
    per = max(last) // n + 1
    gen = torch.Generator().manual_seed(seed)
    nb = rows * per + 5
    tables = torch.randperm(nb, generator=gen)[: rows * per].view(rows, per).to(torch.int32)  # disjoint rows
    kv32 = torch.randn(2, nb, n, h, d, generator=gen)
    query32 = torch.randn(rows + 3, h * g, d, generator=gen)
    tok = torch.randperm(rows + 3, generator=gen)[:rows]
    bucket = torch.randint(0, 3, (rows,), generator=gen)
    restart = torch.rand(rows, generator=gen) < 0.4
    acc0 = torch.rand(3, nb, h, n, generator=gen)
    index = [t.to(device) for t in (tok, torch.tensor(last), tables, bucket, restart)]
    base = (16,) if quick else (32,)
    cases = [(dt, form, cap, tile) for dt in (torch.float32, torch.bfloat16) for form in ("sum", "count", "none")
             for cap in (None, 5.0) for tile in base]
    extra = (32,) if quick else (16, 64)  # other tiles on two cases
    cases += [(torch.float32, "sum", None, t) for t in extra] + [(torch.bfloat16, "count", 5.0, t) for t in extra]
    rows_out = []
    for dtype, form, cap, tile in cases:
        name = f"decode {str(dtype).split('.')[-1]} {form} softcap={cap} tile={tile}"
        row: dict = {"check": name}
        try:
            kv, query = kv32.to(dtype).to(device), query32.to(dtype).to(device)
            acc_t = None if form == "none" else acc0.clone().to(device)
            acc_r = None if form == "none" else acc0.clone().to(device)
            out_t = torch.zeros(rows, h * g, d, device=device)
            out_r = torch.zeros(rows, h * g, d, device=device)
            scale = d ** -0.5
            paged_decode(query, kv, *index, acc_t, out_t, budget, scale, cap, form == "count", tile=tile)
            near = decode_torch(query, kv, *index, acc_r, out_r, budget, scale, cap, form == "count")
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            out_err = float((out_t - out_r).abs().max())
            row["out_err"] = out_err
            ok = out_err <= tol * (1.0 if dtype == torch.float32 else max(1.0, float(out_r.abs().max())))
            ok = ok and bool(out_t.abs().sum() > 0)
            if acc_t is not None and acc_r is not None:
                diff = (acc_t - acc_r).abs()
                bound = tol * (1.0 if dtype == torch.float32 else torch.clamp(acc_r.abs(), min=1.0))
                bad = diff > bound
                if near is not None:
                    row["threshold_ties"] = int((bad & near).sum())
                    bad &= ~near
                row["acc_err"] = float(diff.max() if near is None else diff.masked_fill(near, 0).max())
                ok = ok and not bool(bad.any()) and not torch.equal(acc_t.cpu(), acc0)
            row["ok"] = ok
        except Exception as e:  # one line per failing check; the others still run
            row.update(ok=False, error=_error(e))
        rows_out.append(row)
    return rows_out


# -- the rounds check ------------------------------------------------------------------------------------------
class DeviceLayer:
    """One layer's plugin state on the device, in vLLM's GPU layout: what ``PagedLayer`` keeps on the CPU.

    Per physical slot (``block * N + offset``) and KV head: the token's position (``pos``, int32) and the
    importance ring (``acc``, (NB, num_blocks, H_kv, N) float32). Prompts within the budget are attended by the
    core, as the plugin does; decode steps by :func:`paged_decode`; rounds by :meth:`round`.

    Parameters
    ----------
    settings : PluginSettings
    heads, kv_heads, head_size : int
    scale : float
    kv_cache : Tensor, shape (2, num_blocks, N, H_kv, D)
    tile : int
        The kernel's tokens per iteration.
    """

    def __init__(self, settings: PluginSettings, heads: int, kv_heads: int, head_size: int, scale: float,
                 kv_cache: torch.Tensor, tile: int = 32):
        self.core = PagedLayer(settings, 0, heads, kv_heads, head_size, scale, None, compiled=False)
        self.settings, self.kv, self.tile, self.scale = settings, kv_cache, tile, scale
        _, nb, n, h, _ = kv_cache.shape
        self.block, self.heads, self.kv_heads, self.head_size = n, heads, kv_heads, head_size
        device = kv_cache.device
        self.pos = torch.full((nb * n, h), -1, dtype=torch.int32, device=device)
        imp = self.core.importance
        self.acc = None if imp is None else torch.zeros(imp.n_buckets, nb, h, n, device=device)
        self.count = imp is not None and imp.form == "count"
        self.rounds = 0
        self.selected_on: set[str] = set()  # devices the core's selection returned its victims on

    @torch.no_grad()
    def step(self, plan: StepPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             output: torch.Tensor) -> None:
        """One engine step (the step's K/V are in the cache already); the plan is the plugin's, made on the host."""
        device = self.kv.device
        for i, a, b in plan.prefills:
            self._prefill(plan.block_table[i].to(device), query[a:b], key[a:b], value[a:b], output[a:b])
        if plan.dec_tok is not None and plan.dec_last is not None:
            tok, last = plan.dec_tok.to(device), plan.dec_last.to(device)
            self.pos[plan.dec_slots.to(device)] = last.to(torch.int32)[:, None]
            ctx = torch.empty(tok.shape[0], self.heads, self.head_size, device=device)
            paged_decode(query, self.kv, tok, last, plan.dec_tables.to(device), plan.dec_bucket.to(device),
                         plan.dec_restart.to(device), self.acc, ctx, self.core.budget, self.scale, None, self.count,
                         tile=self.tile)
            output.index_copy_(0, tok, ctx.to(output.dtype))
        if plan.round_window is not None and plan.round_seen is not None:
            self.round(plan.round_window.to(device), plan.round_seen)

    def _prefill(self, table_row: torch.Tensor, q, k, v, out) -> None:
        """A prompt within the budget: attended exactly by a one-row core layer, all of it kept in place."""
        config = self.settings.config
        one = self.core.budgeted(DenseKVStore(), make_prefill(config))
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H_kv, T, D)
        one.allocate(k4, v4)
        ctx = attend(one, q.transpose(0, 1)[None], k4, v4, None, self.scale, None, config.query_tile)
        out.copy_(ctx[0].transpose(0, 1).to(out.dtype))
        length = int(one.slots.lengths[0])
        if length != q.shape[0]:
            raise RuntimeError("a prompt longer than the budget: not simulated here")
        kept = one.slots.positions[0, :, :length].long().to(self.kv.device)  # (H_kv, T)
        where = table_row.long()[kept // self.block] * self.block + kept % self.block
        heads = torch.arange(self.kv_heads, device=self.kv.device)[:, None].expand_as(where)
        self.pos[where, heads] = kept.to(torch.int32)
        if self.acc is not None:
            held = one.state.acc[:, 0, :, :length].float().to(self.kv.device)  # type: ignore[union-attr]
            self.acc[:, where // self.block, heads, where % self.block] = held

    def round(self, window: torch.Tensor, seen: torch.Tensor) -> None:
        """``PagedLayer._round`` on the device: each rounding row picks ``drop`` victims per KV head and swaps them
        into its window's leaving slots. window (Rr, B) physical slots, oldest first (device); seen (Rr,) host."""
        core, device, n = self.core, window.device, self.block
        rr, b_ = window.shape
        m, h = core.drop, self.kv_heads
        pos = self.pos[window].permute(0, 2, 1).long()  # (Rr, H_kv, B) each logical slot's token position
        order = pos.argsort(dim=-1)  # position order: the core's stored order
        positions = pos.gather(-1, order)
        blk, off = window // n, window % n
        heads = torch.arange(h, device=device)[None, :, None]
        state = None
        if self.acc is not None:
            imp = core.importance
            assert imp is not None
            state = ImportanceState(imp.form, imp.bucket_steps, imp.n_buckets, imp.value_weighted, imp.mean_cap)
            acc = self.acc[:, blk, :, off].permute(2, 0, 3, 1)  # (Rr, B, NB, H_kv) -> (NB, Rr, H_kv, B)
            state.acc = acc.gather(-1, order[None].expand_as(acc))
            state._allocated = True

        def read(length: int) -> tuple[torch.Tensor, torch.Tensor]:
            slots = window[:, None, :].expand(rr, h, b_).gather(-1, order)
            return self.kv[0, slots // n, slots % n, heads], self.kv[1, slots // n, slots % n, heads]

        table = _Slots(positions, seen)
        view = LayerView(core.layer_idx, b_, self.rounds, state, table, read)  # type: ignore[arg-type]
        scores = core.method.score(view)  # (Rr, H_kv, B)
        shield = None
        for part in core.shields:
            mask = part.mask(positions)
            shield = mask if shield is None else shield | mask
        full = torch.full((rr,), b_, dtype=torch.long)
        victims = lowest(scores, full, core.recent, torch.full((rr,), m, dtype=torch.long), shield)
        self.selected_on.add(victims.device.type)
        chosen = torch.sort((~victims).to(torch.uint8), dim=-1, stable=True).indices[..., :m]  # oldest first
        vlog = order.gather(-1, chosen)  # (Rr, H_kv, m): the victims' logical slots
        idx = torch.arange(b_, device=device)
        isv = torch.zeros(rr, h, b_, dtype=torch.bool, device=device).scatter_(-1, vlog, True)
        displaced = ~isv & (idx < m)  # kept tokens in the leaving slots
        free = isv & (idx >= m)  # victims' slots outside them
        d_list = torch.sort(torch.where(displaced, idx, b_ + idx), dim=-1).indices[..., :m]
        f_list = torch.sort(torch.where(free, idx, b_ + idx), dim=-1).indices[..., :m]
        valid = torch.arange(m, device=device) < displaced.sum(-1, keepdim=True)
        dst = torch.cat([idx[:m].expand(rr, h, m), torch.where(valid, f_list, 0)], dim=-1)  # (Rr, H_kv, 2m)
        src = torch.cat([vlog, torch.where(valid, d_list, vlog[..., :1])], dim=-1)  # padding repeats pair 0
        wide = window[:, None, :].expand(rr, h, b_)
        pd, ps = wide.gather(-1, dst), wide.gather(-1, src)
        hd = heads.expand_as(pd)
        self.kv[:, pd // n, pd % n, hd] = self.kv[:, ps // n, ps % n, hd]  # K and V; the reads come first
        self.pos[pd, hd] = self.pos[ps, hd]
        if self.acc is not None:
            self.acc[:, pd // n, hd, pd % n] = self.acc[:, ps // n, hd, ps % n]
        self.rounds += 1

    def stored_positions(self, table_row: torch.Tensor, seen: int) -> torch.Tensor:
        """The positions a request's window holds per KV head, ascending (H_kv, L)."""
        count = min(seen, self.core.budget)
        positions = torch.arange(seen - count, seen, device=self.kv.device)
        slots = table_row.long()[positions // self.block] * self.block + positions % self.block
        return self.pos[slots].T.long().sort(dim=-1).values


def serve(plugin: dict, device: torch.device, dims: tuple[int, int, int, int], steps: int, seed: int,
          tile: int) -> dict:
    """Four requests stepped as vLLM would (one arriving later), on the device; each also fed alone to a one-row
    core layer in rounds on the CPU. Freed blocks are poisoned with NaN, so a read behind a window shows."""
    hq, h, d, n = dims
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(seed)
    settings = parse(plugin)
    budget = settings.budget
    prompts = {"a": budget, "b": 9, "c": 4, "d": budget - 2}  # within the budget: prompts need no eviction
    arrive = {"a": 0, "b": 0, "c": 0, "d": 5}
    per = -(-(max(prompts.values()) + steps + 1) // n)
    table = torch.randperm(len(prompts) * per, generator=gen).view(len(prompts), per).to(torch.int32)
    kv = torch.zeros(2, len(prompts) * per, n, h, d, device=device)
    layer = DeviceLayer(settings, hq, h, d, scale, kv, tile)
    planner = Planner(settings)
    rows = {rid: i for i, rid in enumerate(prompts)}
    seen = dict.fromkeys(prompts, 0)
    alone: dict = {}
    worst, mismatches, decoded = 0.0, [], 0
    for step in range(steps):
        running = [rid for rid in prompts if arrive[rid] <= step]
        chunks = {rid: (prompts[rid] if seen[rid] == 0 else 1) for rid in running}
        t = sum(chunks.values())
        q, k, v = (torch.randn(t, x, d, generator=gen) for x in (hq, h, h))
        new = {rid: torch.arange(seen[rid], seen[rid] + chunks[rid]) for rid in running}
        slots = torch.cat([table[rows[rid], new[rid] // n].long() * n + new[rid] % n for rid in running])
        where = slots.to(device)
        kv[0, where // n, where % n] = k.to(device)  # vLLM's cache update, before the layer runs
        kv[1, where // n, where % n] = v.to(device)
        starts = torch.tensor([0] + [chunks[rid] for rid in running]).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([seen[rid] + chunks[rid] for rid in running], dtype=torch.int32)
        plan = planner.plan(running, starts, seq_lens, table[[rows[r] for r in running]], slots, n)
        out = torch.full((t, hq, d), float("nan"), device=device)
        layer.step(plan, q.to(device), k.to(device), v.to(device), out)
        got = out.cpu()
        for i, rid in enumerate(running):
            a, b = int(starts[i]), int(starts[i + 1])
            k4, v4 = k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None]  # (1, H_kv, T, D)
            if seen[rid] == 0:
                alone[rid] = layer.core.budgeted(DenseKVStore(), make_prefill(settings.config), rounds=True)
                alone[rid].allocate(k4, v4)
            want = attend(alone[rid], q[a:b].transpose(0, 1)[None], k4, v4, None, scale, None,
                          settings.config.query_tile)[0].transpose(0, 1)  # (T, H_q, D)
            gap = (got[a:b] - want).abs().max()
            worst = max(worst, float("inf") if bool(gap.isnan()) else float(gap))
            decoded += int(b - a == 1)
            seen[rid] += b - a
            mine = layer.stored_positions(table[rows[rid]].to(device), seen[rid]).cpu().tolist()
            if mine != alone[rid].slots.row(0).sort(dim=-1).values.tolist():
                mismatches.append(f"{rid}@{step}")
        for rid in running:  # what vLLM's sliding-window manager frees: blocks wholly before p + 2 - B
            for blk in range(max(0, seen[rid] + 1 - budget) // n):
                kv[:, int(table[rows[rid], blk])] = float("nan")
    on_device = layer.selected_on == {device.type}
    ok = worst <= 1e-4 and not mismatches and layer.rounds > 0 and on_device
    return {"ok": ok, "output_err": worst, "rounds": layer.rounds, "decode_rows": decoded,
            "position_mismatches": mismatches[:10], "selection_on": sorted(layer.selected_on)}


def check_rounds(device: torch.device, quick: bool, seed: int) -> list[dict]:
    """Each plugin setting served on the device against the core, one line each."""
    dims = (6, 2, 16, 16) if quick else (9, 3, 64, 16)  # H_q, H_kv, D, N
    settings = {k: PLUGINS[k] for k in QUICK} if quick else {**PLUGINS, **WIDE}
    rows = []
    for name, plugin in settings.items():
        steps = (16 if quick else 30) if plugin["budget"] < 40 else 70
        row: dict = {"check": f"rounds {name}", "plugin": plugin, "steps": steps}
        try:
            row.update(serve(plugin, device, dims, steps, seed, 16 if quick else 32))
        except Exception as e:
            row.update(ok=False, error=_error(e))
        rows.append(row)
    return rows


# -- timings ---------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median milliseconds of ``reps`` runs of ``fn`` after warm-up runs (CUDA events on a GPU)."""
    for _ in range(2 if device.type == "cuda" else 1):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's fused attention, GQA by ``enable_gqa`` where torch has it (else K/V repeated per query head)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=scale)


def time_step(device: torch.device, quick: bool, reps: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The Triton step (with the importance update, and without) per tile, and SDPA over the same windows held
    contiguously; also a check that the two outputs agree (the long windows the decode check does not reach)."""
    rr, h, g, d, n = (4, 2, 3, 16, 16) if quick else (32, 3, 3, 64, 16)
    windows = (32,) if quick else (512, 2048)
    tiles = (16,) if quick else (16, 32, 64)
    scale = d ** -0.5
    torch.manual_seed(seed)
    timings, checks = [], []
    for w in windows:
        per = (w + rr) // n + 2
        nb = rr * per
        tables = torch.randperm(nb).view(rr, per).to(torch.int32).to(device)
        last = (w + torch.arange(rr)).to(device)  # full windows of w tokens, starting mid-block
        tok = torch.arange(rr, device=device)
        bucket = torch.zeros(rr, dtype=torch.long, device=device)
        restart = torch.zeros(rr, dtype=torch.int32, device=device)
        x = last[:, None] - w + 1 + torch.arange(w, device=device)  # (R, W) each window's positions
        phys_b, phys_o = tables.long().gather(1, x // n), x % n
        for dtype in (torch.bfloat16, torch.float32):
            kv = torch.randn(2, nb, n, h, d, device=device).to(dtype)
            query = torch.randn(rr, h * g, d, device=device).to(dtype)
            acc = torch.zeros(1, nb, h, n, device=device)
            out = torch.empty(rr, h * g, d, device=device)
            row: dict = {"what": "step", "window": w, "requests": rr, "dtype": str(dtype).split(".")[-1],
                         "heads": [h * g, h], "head_size": d, "block": n}
            args = (query, kv, tok, last, tables, bucket, restart)
            ms = {tile: timed(partial(paged_decode, *args, acc, out, w, scale, None, False, tile=tile), reps, device)
                  for tile in tiles}
            row.update({f"triton_tile{tile}_ms": t for tile, t in ms.items()})
            best = row["best_tile"] = min(ms, key=ms.__getitem__)
            step = partial(paged_decode, *args, None, out, w, scale, None, False, tile=best)
            row["triton_out_only_ms"] = timed(step, reps, device)
            qc = query.view(rr, h * g, 1, d)
            kc = kv[0, phys_b, phys_o].permute(0, 2, 1, 3).contiguous()  # (R, H_kv, W, D)
            vc = kv[1, phys_b, phys_o].permute(0, 2, 1, 3).contiguous()
            row["sdpa_ms"] = timed(partial(sdpa, qc, kc, vc, scale), reps, device)
            timings.append(row)
            step()  # the output alone, at the best tile
            err = float((out - sdpa(qc, kc, vc, scale)[:, :, 0].float()).abs().max())
            tol = 1e-3 if dtype == torch.float32 else 2e-2
            checks.append({"check": f"step vs sdpa {row['dtype']} window={w}", "ok": err <= tol, "out_err": err})
    return timings, checks


def time_round(device: torch.device, quick: bool, reps: int, seed: int) -> tuple[list[dict], list[dict]]:
    """One round over 32 rows with full windows, at the defaults (drop = 5% of the budget); no checks."""
    rr, hq, h, d, n = (4, 6, 2, 16, 16) if quick else (32, 9, 3, 64, 16)
    torch.manual_seed(seed)
    rows = []
    for budget in (32,) if quick else (512, 2048):
        settings = parse({"budget": budget})
        per = (budget + rr + 40) // n + 2
        nb = rr * per
        table = torch.randperm(nb).view(rr, per)
        kv = torch.randn(2, nb, n, h, d, device=device).to(torch.bfloat16)
        layer = DeviceLayer(settings, hq, h, d, d ** -0.5, kv)
        seen = budget + 17 + torch.arange(rr)
        positions = seen[:, None] - budget + torch.arange(budget)  # (R, B)
        window = (table.gather(1, positions // n) * n + positions % n).to(device)
        layer.pos[window] = positions.to(device, torch.int32)[..., None].expand(rr, budget, h)
        assert layer.acc is not None
        layer.acc.uniform_()
        ms = timed(partial(layer.round, window, seen), reps, device)
        rows.append({"what": "round", "rows": rr, "budget": budget, "drop": layer.core.drop, "kv_heads": h,
                     "method": "scissorhands", "round_ms": ms})
    return rows, []


# -- the run ---------------------------------------------------------------------------------------------------
def _error(e: BaseException) -> str:
    """The exception's last traceback frame and message, on one line."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}{where}"


def _line(row: dict) -> str:
    detail = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                       if k not in ("check", "ok", "plugin"))
    return f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']}: {detail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu (with TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (what Triton's interpreter runs in seconds)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per measurement (default 50; 3 with --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    if triton is None:
        print("error: Triton is not installed (python -m pip install triton)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cpu" and not INTERPRET:
        print("error: --device cpu runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reps = args.reps or (3 if args.quick else 50)
    start = time.perf_counter()
    checks: list[dict] = []
    for part in (check_decode, check_rounds):
        for row in part(device, args.quick, args.seed):
            print(_line(row), flush=True)
            checks.append(row)
    timings: list[dict] = []
    for what, timer in (("step", time_step), ("round", time_round)):
        try:
            timed_rows, agree = timer(device, args.quick, reps, args.seed)
        except Exception as e:
            timed_rows, agree = [], [{"check": f"time {what}", "ok": False, "error": _error(e)}]
        timings += timed_rows
        for row in agree:
            print(_line(row), flush=True)
            checks.append(row)
    for row in timings:
        print("time " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    record = {"device": name, "interpreter": INTERPRET, "quick": args.quick, "torch": torch.__version__,
              "triton": triton.__version__, "reps": reps, "ok": all(r["ok"] for r in checks),
              "failed": [r["check"] for r in checks if not r["ok"]], "checks": checks, "timings": timings,
              "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(record, default=str))
    if args.out is not None:
        args.out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
