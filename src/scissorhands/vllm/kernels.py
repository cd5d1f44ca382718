"""The decode step's importance update over vLLM's CPU blocks: one compiled call per layer, and its reference.

For every decoding request, the new query's attention probabilities over the
request's window (the logical positions ``(p - B, p]``) are added to the
importance accumulator of each slot, per KV head, summed over the group's query
heads (``sum`` and ``mean``) or counted where they exceed ``1/n`` (``count``).
The accumulator is kept per *physical* slot of vLLM's cache,
``acc[bucket, block, kv_head, offset]``, so the update reads K where it lies,
block by block, with no gather and no copy, and writes where the token lives.

:func:`observe` runs a C++ operator (``torch.utils.cpp_extension``), built on
first use and cached by torch in ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``); a machine without a C++ compiler gets one
line saying so. :func:`observe_reference` is the same update in plain torch,
one request at a time: the tests hold the two equal, and it is what the
operator replaces.

Why by hand: vLLM's CPU kernels return no probabilities, and no library
operator computes a softmax over paged blocks in place; reading the window's
keys once, where they lie, is what makes the step cheap.
"""

from __future__ import annotations

import hashlib
import sys

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void observe_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& tok,
                         const torch::Tensor& last, const torch::Tensor& tables, const torch::Tensor& bucket,
                         const torch::Tensor& restart, torch::Tensor& acc, int64_t budget, double scale,
                         double softcap, bool count) {
  const int64_t R = tok.size(0), H = kv_cache.size(1), N = kv_cache.size(2), D = kv_cache.size(3) / 2;
  const int64_t Hq = query.size(1), g = Hq / H, nb = kv_cache.size(0), maxblk = tables.size(1);
  const float* q = query.data_ptr<float>();
  const T* kv = kv_cache.data_ptr<T>();
  const int64_t* tok_p = tok.data_ptr<int64_t>();
  const int64_t* last_p = last.data_ptr<int64_t>();
  const int64_t* bucket_p = bucket.data_ptr<int64_t>();
  const bool* restart_p = restart.data_ptr<bool>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  float* a = acc.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits, contrib;
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, p = last_p[r];
      const int64_t ws = std::max<int64_t>(0, p - budget + 1), L = p - ws + 1;
      logits.assign(g * L, 0.f);
      contrib.assign(L, 0.f);
      const float* qr = q + (tok_p[r] * Hq + h * g) * D;
      for (int64_t x0 = ws; x0 <= p;) {  // block by block: each K^T row is read whole and in order
        const int64_t o0 = x0 % N, o1 = std::min<int64_t>(N, o0 + (p - x0 + 1));
        const T* kb = kv + (static_cast<int64_t>(tab[r * maxblk + x0 / N]) * H + h) * N * 2 * D;  // K^T: [D][N]
        for (int64_t j = 0; j < g; ++j) {
          float* lg = logits.data() + j * L + (x0 - ws) - o0;
          const float* qj = qr + j * D;
          for (int64_t d = 0; d < D; ++d) {
            const float qd = qj[d];
            const T* kd = kb + d * N;
            for (int64_t o = o0; o < o1; ++o) lg[o] += qd * static_cast<float>(kd[o]);
          }
        }
        x0 += o1 - o0;
      }
      const float thr = 1.f / static_cast<float>(L);
      for (int64_t j = 0; j < g; ++j) {
        float* lg = logits.data() + j * L;
        float top = -INFINITY;
        for (int64_t x = 0; x < L; ++x) {
          float v = lg[x] * sc;
          if (cap > 0.f) v = std::tanh(v / cap) * cap;
          lg[x] = v;
          top = std::max(top, v);
        }
        for (int64_t x = 0; x < L; ++x) lg[x] = std::exp(lg[x] - top);
        float total = 0.f;
        for (int64_t x = 0; x < L; ++x) total += lg[x];
        const float inv = 1.f / total;
        float* c = contrib.data();
        if (count) {
          for (int64_t x = 0; x < L; ++x) c[x] += (lg[x] * inv > thr) ? 1.f : 0.f;
        } else {
          for (int64_t x = 0; x < L; ++x) c[x] += lg[x] * inv;
        }
      }
      float* ab = a + bucket_p[r] * nb * H * N;
      for (int64_t x = ws; x <= p; ++x) {
        float* slot = ab + (static_cast<int64_t>(tab[r * maxblk + x / N]) * H + h) * N + x % N;
        if (restart_p[r] || x == p) *slot = 0.f;  // a bucket that starts now; the new token's fresh slot
        *slot += contrib[x - ws];
      }
    }
  });
}

void observe(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor tok, torch::Tensor last,
             torch::Tensor tables, torch::Tensor bucket, torch::Tensor restart, torch::Tensor acc, int64_t budget,
             double scale, double softcap, bool count) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: float32, contiguous");
  TORCH_CHECK(acc.scalar_type() == torch::kFloat32 && acc.is_contiguous(), "acc: float32, contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.scalar_type() == torch::kInt32 && tables.is_contiguous(),
              "kv_cache and tables: contiguous, tables int32");
  if (kv_cache.scalar_type() == torch::kFloat32) {
    observe_impl<float>(query, kv_cache, tok, last, tables, bucket, restart, acc, budget, scale, softcap, count);
  } else if (kv_cache.scalar_type() == torch::kBFloat16) {
    observe_impl<c10::BFloat16>(query, kv_cache, tok, last, tables, bucket, restart, acc, budget, scale, softcap,
                                count);
  } else if (kv_cache.scalar_type() == torch::kFloat16) {
    observe_impl<c10::Half>(query, kv_cache, tok, last, tables, bucket, restart, acc, budget, scale, softcap, count);
  } else {
    TORCH_CHECK(false, "kv_cache: float32, bfloat16 or float16");
  }
}
"""

_CFLAGS = ["-O3", "-mavx2", "-mfma"]
_OPS: dict = {}


def _ops():
    """The compiled operator, built on first use (about a minute) and cached by torch; one line if it cannot be."""
    if "ops" not in _OPS:
        from torch.utils import cpp_extension

        key = hashlib.sha256((_SOURCE + " ".join(_CFLAGS) + torch.__version__ + sys.prefix).encode()).hexdigest()[:12]
        try:
            _OPS["ops"] = cpp_extension.load_inline(name=f"scissorhands_paged_{key}", cpp_sources=_SOURCE,
                                                    functions=["observe"], extra_cflags=_CFLAGS, verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = next((x.strip() for x in lines if "error" in x.lower() and "Error building" not in x), lines[0])
            raise RuntimeError(f"scissorhands: cannot build the paged importance operator with "
                               f"torch.utils.cpp_extension (a C++ compiler, g++, is needed): {first}") from None
    return _OPS["ops"]


def build() -> None:
    """Build (or load) the operator now."""
    _ops()


def observe(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
            softcap: float | None, count: bool) -> None:
    """Add each decoding request's query attention over its window to ``acc`` (NB, num_blocks, H_kv, N), in place.

    query (T, H_q, D) the step's queries; kv_cache (num_blocks, H_kv, N, 2D) vLLM's CPU layout (K transposed in
    each block); tok (R,) each request's token index in ``query``; last (R,) its position ``p``; tables (R, blocks)
    int32 its block-table row; bucket (R,) the ring slot its step adds to; restart (R,) bool, whether that slot
    starts a new bucket (zeroed over the window first); budget: the window ``B``. The new token's own slot
    (position ``p``) is zeroed before it is added to: a fresh token has no history.
    """
    _ops().observe(query.float().contiguous(), kv_cache, tok, last, tables.contiguous(), bucket, restart, acc,
                   budget, float(scale), float(softcap or 0.0), bool(count))


def observe_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
                      softcap: float | None, count: bool) -> None:
    """:func:`observe` in plain torch, one request at a time (the tests' reference)."""
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    keys_t = kv_cache.view(nb, h, 2, n * d)[:, :, 0].view(nb, h, d, n)
    g = query.shape[1] // h
    for r in range(tok.shape[0]):
        p = int(last[r])
        x = torch.arange(max(0, p - budget + 1), p + 1)
        blocks, offs = tables[r].long()[x // n], x % n
        k = keys_t[blocks, :, :, offs].float()  # (L, H_kv, D)
        q = query[int(tok[r])].float().view(h, g, d)
        logits = torch.einsum("hgd,lhd->hgl", q, k) * scale
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        probs = logits.softmax(-1)
        contrib = (probs > 1.0 / len(x)).float().sum(1) if count else probs.sum(1)  # (H_kv, L)
        ring = acc[int(bucket[r])]  # (num_blocks, H_kv, N)
        if bool(restart[r]):
            ring[blocks, :, offs] = 0
        ring[blocks[-1], :, offs[-1]] = 0
        ring[blocks, :, offs] += contrib.T
