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
import platform
import sys

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// Where K[token o][dim d] and V[o][d] of one (block, KV head) lie, from the start of its region of N * 2D elements.
// VEC: K transposed ([D][N]), then V ([N][D]). AMX (2-byte types): K in groups of 16 tokens, each [D/2][16][2]
// (pairs of dims per token); V in groups of 16 dims, each [N/2][16][2] (pairs of tokens per dim).
enum Layout { VEC = 0, AMX = 1 };

template <int LAYOUT>
static inline int64_t k_at(int64_t o, int64_t d, int64_t N, int64_t D) {
  if (LAYOUT == VEC) return d * N + o;
  return (o / 16) * 16 * D + (d / 2) * 32 + (o % 16) * 2 + d % 2;
}

template <int LAYOUT>
static inline int64_t v_at(int64_t o, int64_t d, int64_t N, int64_t D) {
  if (LAYOUT == VEC) return N * D + o * D + d;
  return N * D + (d / 16) * 16 * N + (o / 2) * 32 + (d % 16) * 2 + o % 2;
}

template <typename T, int LAYOUT>
static void decode_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& tok,
                        const torch::Tensor& last, const torch::Tensor& tables, const torch::Tensor& bucket,
                        const torch::Tensor& restart, torch::Tensor& acc, torch::Tensor& out, int64_t budget,
                        double scale, double softcap, bool count, bool want_acc, bool want_out) {
  const int64_t R = tok.size(0), H = kv_cache.size(1), N = kv_cache.size(2), D = kv_cache.size(3) / 2;
  const int64_t Hq = query.size(1), g = Hq / H, nb = kv_cache.size(0), maxblk = tables.size(1);
  const float* q = query.data_ptr<float>();
  const T* kv = kv_cache.data_ptr<T>();
  const int64_t* tok_p = tok.data_ptr<int64_t>();
  const int64_t* last_p = last.data_ptr<int64_t>();
  const int64_t* bucket_p = bucket.data_ptr<int64_t>();
  const bool* restart_p = restart.data_ptr<bool>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  float* a = want_acc ? acc.data_ptr<float>() : nullptr;
  float* o_p = want_out ? out.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits, contrib, qs(g * D), ctx(g * D);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, p = last_p[r];
      const int64_t ws = std::max<int64_t>(0, p - budget + 1), L = p - ws + 1;
      logits.assign(g * L, 0.f);
      const float* qr = q + (tok_p[r] * Hq + h * g) * D;
      for (int64_t i = 0; i < g * D; ++i) qs[i] = qr[i] * sc;
      // Logits, block by block: each block's keys are read once for the group's query heads.
      for (int64_t x0 = ws; x0 <= p;) {
        const int64_t o0 = x0 % N, o1 = std::min<int64_t>(N, o0 + (p - x0 + 1));
        const T* kb = kv + (static_cast<int64_t>(tab[r * maxblk + x0 / N]) * H + h) * N * 2 * D;
        if (LAYOUT == VEC) {
          for (int64_t d = 0; d < D; ++d) {
            const T* kd = kb + d * N;
            for (int64_t j = 0; j < g; ++j) {
              const float qd = qs[j * D + d];
              float* lg = logits.data() + j * L + (x0 - ws) - o0;
              for (int64_t o = o0; o < o1; ++o) lg[o] += qd * static_cast<float>(kd[o]);
            }
          }
        } else {
          for (int64_t o = o0; o < o1; ++o) {
            for (int64_t j = 0; j < g; ++j) {
              const float* qj = qs.data() + j * D;
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += qj[d] * static_cast<float>(kb[k_at<LAYOUT>(o, d, N, D)]);
              logits[j * L + (x0 - ws) + (o - o0)] = s;
            }
          }
        }
        x0 += o1 - o0;
      }
      // Softmax per query head (after the soft cap), in place: logits become probabilities.
      for (int64_t j = 0; j < g; ++j) {
        float* lg = logits.data() + j * L;
        if (cap > 0.f) for (int64_t x = 0; x < L; ++x) lg[x] = std::tanh(lg[x] / cap) * cap;
        float top = lg[0];
        for (int64_t x = 1; x < L; ++x) top = std::max(top, lg[x]);
        float total = 0.f;
        for (int64_t x = 0; x < L; ++x) {
          lg[x] = std::exp(lg[x] - top);
          total += lg[x];
        }
        const float inv = 1.f / total;
        for (int64_t x = 0; x < L; ++x) lg[x] *= inv;
      }
      if (want_out) {  // the context: probabilities times values, read token by token where they lie
        std::fill(ctx.begin(), ctx.end(), 0.f);
        for (int64_t x = ws; x <= p; ++x) {
          const T* vb = kv + (static_cast<int64_t>(tab[r * maxblk + x / N]) * H + h) * N * 2 * D;
          const int64_t off = x % N;
          for (int64_t j = 0; j < g; ++j) {
            const float pj = logits[j * L + (x - ws)];
            float* cj = ctx.data() + j * D;
            if (LAYOUT == VEC) {
              const T* vr = vb + N * D + off * D;
              for (int64_t d = 0; d < D; ++d) cj[d] += pj * static_cast<float>(vr[d]);
            } else {
              for (int64_t d = 0; d < D; ++d) cj[d] += pj * static_cast<float>(vb[v_at<LAYOUT>(off, d, N, D)]);
            }
          }
        }
        float* dst = o_p + (r * Hq + h * g) * D;
        std::copy(ctx.begin(), ctx.end(), dst);
      }
      if (want_acc) {  // each slot's share, summed (or counted above 1/L) over the group's query heads
        contrib.assign(L, 0.f);
        const float thr = 1.f / static_cast<float>(L);
        for (int64_t j = 0; j < g; ++j) {
          const float* pr = logits.data() + j * L;
          if (count) {
            for (int64_t x = 0; x < L; ++x) contrib[x] += (pr[x] > thr) ? 1.f : 0.f;
          } else {
            for (int64_t x = 0; x < L; ++x) contrib[x] += pr[x];
          }
        }
        float* ab = a + bucket_p[r] * nb * H * N;
        for (int64_t x = ws; x <= p; ++x) {
          float* slot = ab + (static_cast<int64_t>(tab[r * maxblk + x / N]) * H + h) * N + x % N;
          if (restart_p[r] || x == p) *slot = 0.f;  // a bucket that starts now; the new token's fresh slot
          *slot += contrib[x - ws];
        }
      }
    }
  });
}

template <typename T>
static void dispatch_layout(int64_t layout, const torch::Tensor& query, const torch::Tensor& kv_cache,
                            const torch::Tensor& tok, const torch::Tensor& last, const torch::Tensor& tables,
                            const torch::Tensor& bucket, const torch::Tensor& restart, torch::Tensor& acc,
                            torch::Tensor& out, int64_t budget, double scale, double softcap, bool count,
                            bool want_acc, bool want_out) {
  if (layout == VEC) {
    decode_impl<T, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                        count, want_acc, want_out);
  } else {
    TORCH_CHECK(sizeof(T) == 2, "the amx layout holds 2-byte K/V");
    decode_impl<T, AMX>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                        count, want_acc, want_out);
  }
}

void decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor tok, torch::Tensor last,
            torch::Tensor tables, torch::Tensor bucket, torch::Tensor restart, torch::Tensor acc, torch::Tensor out,
            int64_t budget, double scale, double softcap, bool count, bool want_acc, bool want_out, int64_t layout) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: float32, contiguous");
  TORCH_CHECK(!want_acc || (acc.scalar_type() == torch::kFloat32 && acc.is_contiguous()), "acc: float32, contiguous");
  TORCH_CHECK(!want_out || (out.scalar_type() == torch::kFloat32 && out.is_contiguous()), "out: float32, contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.scalar_type() == torch::kInt32 && tables.is_contiguous(),
              "kv_cache and tables: contiguous, tables int32");
  TORCH_CHECK(layout == VEC || layout == AMX, "layout: 0 (vec) or 1 (amx)");
  if (kv_cache.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(layout == VEC, "the amx layout holds 2-byte K/V");
    decode_impl<float, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                            count, want_acc, want_out);
  } else if (kv_cache.scalar_type() == torch::kBFloat16) {
    dispatch_layout<c10::BFloat16>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget,
                                   scale, softcap, count, want_acc, want_out);
  } else if (kv_cache.scalar_type() == torch::kFloat16) {
    dispatch_layout<c10::Half>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale,
                               softcap, count, want_acc, want_out);
  } else {
    TORCH_CHECK(false, "kv_cache: float32, bfloat16 or float16");
  }
}
"""

#: Built for the machine it runs on (it is built there, on first use). Fast maths lets the compiler vectorise the
#: softmax's exponentials with glibc's vector maths; the operator reads no slot outside a window and starts each
#: maximum from a real logit, so it meets no infinity or NaN.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_OPS: dict = {}
#: Layout codes of the operator: vLLM's CPU kernels "vec" and "vec16" hold K transposed per block, "amx" in tiles.
LAYOUTS = {"vec": 0, "vec16": 0, "amx": 1}


def _machine() -> str:
    """What ``-march=native`` builds for: the CPU's model and flags (a cached build is per machine)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor()
    return "".join(line for line in text.splitlines(True) if line.startswith(("model name", "flags")))[:4096]


def _ops():
    """The compiled operator, built on first use (about a minute) and cached by torch; one line if it cannot be."""
    if "ops" not in _OPS:
        from torch.utils import cpp_extension

        key = hashlib.sha256((_SOURCE + " ".join(_CFLAGS) + torch.__version__ + sys.prefix + _machine()).encode())
        try:
            _OPS["ops"] = cpp_extension.load_inline(name=f"scissorhands_paged_{key.hexdigest()[:12]}",
                                                    cpp_sources=_SOURCE, functions=["decode"], extra_cflags=_CFLAGS,
                                                    extra_ldflags=["-lmvec"], verbose=False)
        except (RuntimeError, OSError, ImportError) as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = next((x.strip() for x in lines if "error" in x.lower() and "Error building" not in x), lines[0])
            raise RuntimeError(f"scissorhands: cannot build the paged attention operator with "
                               f"torch.utils.cpp_extension (a C++ compiler, g++, is needed): {first}") from None
    return _OPS["ops"]


def build() -> None:
    """Build (or load) the operator now."""
    _ops()


_NONE = torch.empty(0)


def decode(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
           softcap: float | None, count: bool, layout: str = "vec") -> None:
    """Attend each decoding request's new query over its window, and add its probabilities to ``acc``, in place.

    query (T, H_q, D) the step's queries; kv_cache (num_blocks, H_kv, N, 2D) vLLM's CPU cache in ``layout``
    ("vec"/"vec16": K transposed in each block; "amx": vLLM's AMX tiles, 2-byte types); tok (R,) each request's
    token index in ``query``; last (R,) its position ``p``; tables (R, blocks) int32 its block-table row; bucket
    (R,) the ring slot its step adds to; restart (R,) bool, whether that slot starts a new bucket (zeroed over
    the window first); budget: the window ``B``, the logical slots ``(p - B, p]``. ``acc`` (NB, num_blocks,
    H_kv, N) float32, or None for a method with no importance; the new token's own slot (position ``p``) is
    zeroed before it is added to: a fresh token has no history. ``out`` (R, H_q, D) float32 receives the
    attention output, or None (the importance only).
    """
    _ops().decode(query.float().contiguous(), kv_cache, tok, last, tables.contiguous(), bucket, restart,
                  _NONE if acc is None else acc, _NONE if out is None else out, budget, float(scale),
                  float(softcap or 0.0), bool(count), acc is not None, out is not None, LAYOUTS[layout])


def observe(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
            softcap: float | None, count: bool, layout: str = "vec") -> None:
    """:func:`decode`'s importance update alone (no output)."""
    decode(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count, layout)


def keys_values(kv_cache: torch.Tensor, layout: str = "vec") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as (num_blocks, H_kv, N, D) float32 copies, whatever the layout (the references read these)."""
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    region = kv_cache.view(nb, h, 2, n * d)
    if LAYOUTS[layout] == 0:
        return region[:, :, 0].view(nb, h, d, n).transpose(2, 3).float(), region[:, :, 1].view(nb, h, n, d).float()
    k = region[:, :, 0].view(nb, h, n // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(nb, h, n, d)
    v = region[:, :, 1].view(nb, h, d // 16, n // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(nb, h, n, d)
    return k.float(), v.float()


def decode_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
                     softcap: float | None, count: bool, layout: str = "vec") -> None:
    """:func:`decode` in plain torch, one request at a time (the tests' reference)."""
    keys, values = keys_values(kv_cache, layout)
    nb, h, n, d = keys.shape
    g = query.shape[1] // h
    for r in range(tok.shape[0]):
        p = int(last[r])
        x = torch.arange(max(0, p - budget + 1), p + 1)
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
                      softcap: float | None, count: bool, layout: str = "vec") -> None:
    """:func:`observe` in plain torch."""
    decode_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count,
                     layout)
