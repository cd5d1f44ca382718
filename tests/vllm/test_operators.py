"""The compiled operators (``scissorhands.vllm.kernels``) on their own, at the shapes vLLM serves, offline.

The decode operator against the same attention in float64 over K/V read back from the cache, for float32 and bf16
K/V in the "vec" layout and bf16 in the "amx" layout (tensors in vLLM's AMX tiles built here, so the amx path is
tested on every machine, AMX or not), with every slot outside the windows NaN. The rounds operator against its
torch path (``rounds.move_victims_reference``, the selection by the core's ``lowest``) on random states, for every
layout and K/V type the plugin reads.
"""

from __future__ import annotations

import pytest
import torch

from scissorhands.vllm import kernels
from scissorhands.vllm.blocks import write_kv
from scissorhands.vllm.rounds import move_victims_reference

N, D = 32, 64  # vLLM's CPU kernels take blocks of multiples of 32; head size of SmolLM2 and Qwen2.5-0.5B


def _window(p: int, budget: int, held: int) -> torch.Tensor:
    """The positions a decode row attends: a held prompt ``[0, held)``, then its window of the last ``budget``."""
    return torch.cat([torch.arange(held), torch.arange(max(held, p - budget + 1), p + 1)])


def _decode_float64(query, kv_cache, tok, last, tables, budget, scale, softcap, count, layout, held):
    """The decode step in float64 over the cache's K/V (outputs (R, H_q, D) and each window's contributions)."""
    keys, values = (x.double() for x in kernels.keys_values(kv_cache, layout))
    h = keys.shape[1]
    outs, contribs = [], []
    for r in range(tok.shape[0]):
        x = _window(int(last[r]), budget, int(held[r]))
        blocks, offs = tables[r].long()[x // N], x % N
        k, v = keys[blocks, :, offs], values[blocks, :, offs]  # (L, H_kv, D)
        q = query[int(tok[r])].double().view(h, -1, D)  # (H_kv, g, D)
        logits = torch.einsum("hgd,lhd->hgl", q, k) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        probs = logits.softmax(-1)
        outs.append(torch.einsum("hgl,lhd->hgd", probs, v).reshape(-1, D))
        contribs.append((probs > 1.0 / len(x)).double().sum(1) if count else probs.sum(1))  # (H_kv, L)
    return torch.stack(outs), contribs


@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("hkv,hq,kept", [(3, 9, False), (2, 14, False), (1, 1, False), (1, 9, False),
                                         (2, 14, True), (1, 9, True)],
                         ids=["g3", "g7", "g1", "g9", "g7-held-prompt", "g9-held-prompt"])
@pytest.mark.parametrize("layout,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)],
                         ids=["vec-float32", "vec-bf16", "amx-bf16"])
def test_the_decode_operator_equals_attention_in_float64(layout, dtype, hkv, hq, softcap, kept):
    """Windows that start and end at odd and even offsets, inside one block and across several, and shorter than
    the budget; groups of 1 to 9 query heads per KV head (more than one register block of 8); every slot no window
    reads is NaN, so a read outside a window (a tile's or a pair's other half) shows. The operator sums in float32
    (bf16 K/V are widened exactly), the reference in float64: D = 64 products per logit and at most 100 terms per
    output, each rounded at float32's 6e-8, plus the vectorised exponential's few ulps, stay far below 1e-5; a
    misread element is off by far more. With a held prompt (keep-prompt) each row also attends its first
    positions, ending at odd and even offsets, beside a window that starts after them: adjacent to it, or with a
    gap of unread (NaN) slots between."""
    gen = torch.Generator().manual_seed(hkv * 100 + hq)
    budget, scale = 100, D ** -0.5
    last = torch.tensor([0, 1, 30, 31, 32, 99, 100, 101, 150, 200, 254])
    held = torch.minimum(last, torch.tensor([0, 1, 7, 17, 32, 20, 33, 64, 45, 90, 100])) if kept else 0 * last
    per = 9
    nb = len(last) * per
    tables = torch.randperm(nb, generator=gen).view(len(last), per).to(torch.int32)  # each request its own blocks
    kv = torch.randn(nb, hkv, N, 2 * D, generator=gen).to(dtype)
    k, v = kernels.keys_values(kv, layout)
    poisoned_k, poisoned_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    for r, p in enumerate(last.tolist()):
        x = _window(p, budget, int(held[r]))
        b, o = tables[r].long()[x // N], x % N
        poisoned_k[b, :, o], poisoned_v[b, :, o] = k[b, :, o], v[b, :, o]
    blocks, heads, offs = (t.reshape(-1) for t in torch.meshgrid(torch.arange(nb), torch.arange(hkv),
                                                                  torch.arange(N), indexing="ij"))
    write_kv(kv, layout, blocks, heads, offs, poisoned_k[blocks, heads, offs], poisoned_v[blocks, heads, offs])
    assert kv.float().isnan().any()
    query = torch.randn(len(last) + 2, hq, D, generator=gen)
    tok = torch.randperm(len(last) + 2, generator=gen)[:len(last)]
    bucket = torch.zeros_like(last)
    restart = torch.zeros(len(last), dtype=torch.bool)
    for count in (False, True):
        acc = torch.zeros(1, nb, hkv, N)
        out = torch.full((len(last), hq, D), float("nan"))
        kernels.decode(query, kv, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap, count,
                       layout, held=held if kept else None)
        want, contribs = _decode_float64(query, kv, tok, last, tables, budget, scale, softcap, count, layout, held)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        for r, p in enumerate(last.tolist()):
            x = _window(p, budget, int(held[r]))
            got = acc[0][tables[r].long()[x // N], :, x % N].T  # (H_kv, L)
            if count:  # whole numbers: equal where no probability sits within rounding of 1/L (none here)
                assert torch.equal(got.double(), contribs[r])
            else:
                torch.testing.assert_close(got.double(), contribs[r], atol=1e-5, rtol=1e-5)


def _state(layout: str, dtype, layers: int, nb: int, h: int, n_buckets: int, gen: torch.Generator):
    """Random caches, positions and importance of ``layers`` layers."""
    if isinstance(dtype, str):  # fp8: bytes, any pattern (the moves copy bytes)
        caches = [torch.randint(0, 256, (nb, h, N, 2 * D), generator=gen, dtype=torch.uint8) for _ in range(layers)]
    else:
        caches = [torch.randn(nb, h, N, 2 * D, generator=gen).to(dtype) for _ in range(layers)]
    pos = torch.stack([torch.randperm(nb * N * h, generator=gen).view(nb * N, h) for _ in range(layers)]).int()
    acc = torch.randint(0, 4, (layers, n_buckets, nb, h, N), generator=gen).float() if n_buckets else None
    return caches, pos, acc


class _Layer:
    """What :func:`move_victims_reference` reads of a layer."""

    def __init__(self, layout: str, drop: int, recent: int, h: int):
        self.layout, self.drop, self.recent, self.kv_heads = layout, drop, recent, h


@pytest.mark.parametrize("drop,recent,shielded,n_buckets", [(5, 4, False, 1), (1, 2, True, 2), (8, 0, True, 0),
                                                            (12, 3, False, 1)],
                         ids=["defaults", "one-shielded", "no-recent-no-importance", "most-of-the-window"])
@pytest.mark.parametrize("layout,dtype", [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16),
                                          ("vec", "fp8"), ("amx", "fp8")],
                         ids=["vec-float32", "vec-bf16", "amx-bf16", "vec-fp8", "amx-fp8"])
def test_the_rounds_operator_equals_the_torch_rounds(layout, dtype, drop, recent, shielded, n_buckets):
    """Three layers, four rounding rows (windows of 24 slots across blocks, in random block order), two KV heads:
    scores with many ties (whole numbers: the older of equal scores must go first), a few infinite and NaN ones,
    shields. The operator and the torch path (the core's ``lowest``, then the swaps layer by layer) must leave
    every cache byte, position and importance equal."""
    gen = torch.Generator().manual_seed(drop * 10 + recent)
    layers_n, h, rr, b_ = 3, 2, 4, 24
    per = -(-b_ // N) + 1
    nb = rr * per + 2
    runs = []
    tables = torch.randperm(nb, generator=gen)[:rr * per].view(rr, per)
    seen = torch.tensor([24, 40, 57, 63])
    positions = seen[:, None] - b_ + torch.arange(b_)[None, :]
    window = tables.gather(1, positions // N) * N + positions % N  # (Rr, B) physical slots, oldest first
    scores = torch.randint(0, 5, (layers_n * rr, h, b_), generator=gen).double()
    scores[0, 0, 3] = float("inf")
    scores[1, 1, 5] = float("-inf")
    scores[2, 0, 7] = float("nan")
    order = torch.stack([torch.randperm(b_, generator=gen) for _ in range(layers_n * rr * h)]).view(-1, h, b_)
    shield = torch.rand(layers_n * rr, h, b_, generator=gen) < 0.2 if shielded else None
    state = _state(layout, dtype, layers_n, nb, h, n_buckets, gen)
    for compiled in (True, False):
        caches = [c.clone() for c in state[0]]
        pos, acc = state[1].clone(), None if state[2] is None else state[2].clone()
        layers = [_Layer(layout, drop, recent, h) for _ in range(layers_n)]
        if compiled:
            kernels.rounds(caches, layout, pos, acc, window, scores, order, shield, recent, drop)
        else:
            move_victims_reference(layers, pos, acc, caches, window, scores, order, shield, N)
        runs.append((caches, pos, acc))
    (ca, pa, aa), (cb, pb, ab) = runs
    assert not torch.equal(pa, state[1])  # tokens moved
    assert torch.equal(pa, pb)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ca, cb))
    assert not all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ca, state[0]))
    if aa is not None:
        assert torch.equal(aa, ab)
