"""The plugin's two compiled operators over vLLM's CPU K/V, and their torch references.

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

Both are C++ (``torch.utils.cpp_extension``), built for the machine they run
on and cached by torch in ``TORCH_EXTENSIONS_DIR`` (by default
``~/.cache/torch_extensions``): at start-up by the plugin's worker, or ahead by
``scissorhands build`` (:mod:`.build`: a stale lock, a missing compiler or an
unwritable folder is one line).
:func:`decode_reference` and :func:`prompt_reference` are the same in plain
torch: the tests hold each pair equal.

Why by hand: vLLM's CPU kernels and torch's fused attention return no
probabilities, and no library operator computes a softmax over paged blocks in
place, or column sums of a causal softmax without writing the ``T x T``
matrix; reading each key once, where it lies, is what makes the step cheap.
"""

from __future__ import annotations

import hashlib
import platform

import torch

from .build import load as load_extension
from .build import module_file as build_module_file

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
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

// One stored element as float: 2- and 4-byte types convert; vLLM's fp8 K/V (bytes) go through a 256-entry table.
template <typename T>
static inline float load(T x, const float* lut) {
  if constexpr (std::is_same_v<T, uint8_t>) return lut[x];
  else return static_cast<float>(x);
}

// One row of L logits becomes probabilities in place: the soft cap (cap > 0), then a softmax.
static inline void softmax_row(float* row, int64_t L, float cap) {
  if (cap > 0.f) for (int64_t x = 0; x < L; ++x) row[x] = std::tanh(row[x] / cap) * cap;
  float top = row[0];
  for (int64_t x = 1; x < L; ++x) top = std::max(top, row[x]);
  float total = 0.f;
  for (int64_t x = 0; x < L; ++x) {
    row[x] = std::exp(row[x] - top);
    total += row[x];
  }
  const float inv = 1.f / total;
  for (int64_t x = 0; x < L; ++x) row[x] *= inv;
}

template <typename T, int LAYOUT>
static void decode_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& tok,
                        const torch::Tensor& last, const torch::Tensor& tables, const torch::Tensor& bucket,
                        const torch::Tensor& restart, torch::Tensor& acc, torch::Tensor& out, int64_t budget,
                        double scale, double softcap, bool count, bool want_acc, bool want_out, const float* lut,
                        float k_scale, float v_scale) {
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
      for (int64_t i = 0; i < g * D; ++i) qs[i] = qr[i] * sc * k_scale;  // K's scale, once
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
              for (int64_t o = o0; o < o1; ++o) lg[o] += qd * load(kd[o], lut);
            }
          }
        } else {
          for (int64_t o = o0; o < o1; ++o) {
            for (int64_t j = 0; j < g; ++j) {
              const float* qj = qs.data() + j * D;
              float s = 0.f;
              for (int64_t d = 0; d < D; ++d) s += qj[d] * load(kb[k_at<LAYOUT>(o, d, N, D)], lut);
              logits[j * L + (x0 - ws) + (o - o0)] = s;
            }
          }
        }
        x0 += o1 - o0;
      }
      // Softmax per query head (after the soft cap), in place: logits become probabilities.
      for (int64_t j = 0; j < g; ++j) softmax_row(logits.data() + j * L, L, cap);
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
              for (int64_t d = 0; d < D; ++d) cj[d] += pj * load(vr[d], lut);
            } else {
              for (int64_t d = 0; d < D; ++d) cj[d] += pj * load(vb[v_at<LAYOUT>(off, d, N, D)], lut);
            }
          }
        }
        float* dst = o_p + (r * Hq + h * g) * D;
        for (int64_t i = 0; i < g * D; ++i) dst[i] = ctx[i] * v_scale;  // V's scale, once
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
                            bool want_acc, bool want_out, const float* lut, float k_scale, float v_scale) {
  if (layout == VEC) {
    decode_impl<T, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                        count, want_acc, want_out, lut, k_scale, v_scale);
  } else {
    TORCH_CHECK(sizeof(T) <= 2, "the amx layout holds 2-byte or fp8 K/V");
    decode_impl<T, AMX>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                        count, want_acc, want_out, lut, k_scale, v_scale);
  }
}

// fp8: 0 none, 1 e4m3 (vLLM's "fp8" and "fp8_e4m3"), 2 e5m2; the bytes' values are multiplied by the scales.
void decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor tok, torch::Tensor last,
            torch::Tensor tables, torch::Tensor bucket, torch::Tensor restart, torch::Tensor acc, torch::Tensor out,
            int64_t budget, double scale, double softcap, bool count, bool want_acc, bool want_out, int64_t layout,
            int64_t fp8, double k_scale, double v_scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: float32, contiguous");
  TORCH_CHECK(!want_acc || (acc.scalar_type() == torch::kFloat32 && acc.is_contiguous()), "acc: float32, contiguous");
  TORCH_CHECK(!want_out || (out.scalar_type() == torch::kFloat32 && out.is_contiguous()), "out: float32, contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.scalar_type() == torch::kInt32 && tables.is_contiguous(),
              "kv_cache and tables: contiguous, tables int32");
  TORCH_CHECK(layout == VEC || layout == AMX, "layout: 0 (vec) or 1 (amx)");
  const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  const auto dtype = kv_cache.scalar_type();
  if (fp8 != 0) {
    TORCH_CHECK(dtype == torch::kByte && (fp8 == 1 || fp8 == 2), "fp8 K/V: a uint8 cache, fp8 1 (e4m3) or 2 (e5m2)");
    std::vector<float> lut(256);
    for (int b = 0; b < 256; ++b) {
      const uint8_t bits = static_cast<uint8_t>(b);
      lut[b] = fp8 == 1 ? static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()))
                        : static_cast<float>(c10::Float8_e5m2(bits, c10::Float8_e5m2::from_bits()));
    }
    dispatch_layout<uint8_t>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale,
                             softcap, count, want_acc, want_out, lut.data(), ks, vs);
  } else if (dtype == torch::kFloat32) {
    TORCH_CHECK(layout == VEC, "the amx layout holds 2-byte or fp8 K/V");
    decode_impl<float, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale, softcap,
                            count, want_acc, want_out, nullptr, ks, vs);
  } else if (dtype == torch::kBFloat16) {
    dispatch_layout<c10::BFloat16>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget,
                                   scale, softcap, count, want_acc, want_out, nullptr, ks, vs);
  } else if (dtype == torch::kFloat16) {
    dispatch_layout<c10::Half>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, scale,
                               softcap, count, want_acc, want_out, nullptr, ks, vs);
  } else {
    TORCH_CHECK(false, "kv_cache: float32, bfloat16, float16, or uint8 holding fp8");
  }
}

// A prompt attended once: exact causal attention of its last Tq queries (all T, or those the caller did not attend
// by a fused attention) over the prompt's own T keys, and in the same pass what the core's prompt-aware prefill
// records from them. Per KV head and tile of queries: one product Q K^T (logits), one
// pass over each row (soft cap, softmax, the row's shares added to its bucket's accumulator and, for the last
// queries, to the snapshot), one product P V (the output). Work items (head, tile) are dealt round-robin, largest
// first, each slot of the thread range keeping its own column sums, which are added up at the end.
void prompt(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor acc,
            torch::Tensor snap, double scale, double softcap, bool count, int64_t bucket_steps, int64_t n_buckets,
            int64_t observe_from, int64_t tile, bool want_acc, bool want_snap) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && v.dim() == 3, "q (H, g, Tq, D), k and v (H, T, D)");
  for (const torch::Tensor* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(), "q, k, v, out: float32, contiguous");
  const int64_t H = q.size(0), g = q.size(1), Tq = q.size(2), D = q.size(3), T = k.size(1), p0 = T - Tq;
  TORCH_CHECK(k.size(0) == H && k.size(2) == D && v.sizes() == k.sizes() && Tq <= T, "k, v: (H, T, D), T >= Tq");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == Tq && out.size(1) == H * g && out.size(2) == D, "out: (Tq, H*g, D)");
  TORCH_CHECK(tile >= 1 && n_buckets >= 1, "tile, n_buckets: >= 1");
  TORCH_CHECK(!want_acc || p0 == 0, "acc: every query's shares, so every query (Tq == T)");
  TORCH_CHECK(!want_snap || observe_from >= p0, "observe_from: a query given (>= T - Tq)");
  const int64_t NB = want_acc ? n_buckets : 0, S = NB + (want_snap ? 1 : 0);  // column sums kept per item slot
  TORCH_CHECK(!want_acc || (acc.scalar_type() == torch::kFloat32 && acc.is_contiguous() && acc.numel() == NB * H * T),
              "acc: float32, contiguous, (n_buckets, H, T)");
  TORCH_CHECK(!want_snap || (snap.scalar_type() == torch::kFloat32 && snap.is_contiguous() && snap.numel() == H * T),
              "snap: float32, contiguous, (H, T)");
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t last_bucket = bucket_steps > 0 ? (T - 1) / bucket_steps : 0;
  const int64_t nt = (Tq + tile - 1) / tile;
  std::vector<int64_t> items;  // head * nt + tile, the costliest (latest) tiles first
  for (int64_t t = nt - 1; t >= 0; --t)
    for (int64_t h = 0; h < H; ++h) items.push_back(h * nt + t);
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<float> sums(S > 0 ? workers * S * H * T : 0, 0.f);
  torch::Tensor qs = q * sc;
  float* o_p = out.data_ptr<float>();
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      float* mine = S > 0 ? sums.data() + w * S * H * T : nullptr;
      for (size_t it = w; it < items.size(); it += workers) {
        // Queries a..a+n-1 of q, at positions p0+a.. of the prompt, see keys 0..e-1.
        const int64_t h = items[it] / nt, a = (items[it] % nt) * tile, n = std::min<int64_t>(Tq, a + tile) - a;
        const int64_t e = p0 + a + n;
        torch::Tensor logits = at::matmul(qs[h].narrow(1, a, n), k[h].narrow(0, 0, e).t()).contiguous();  // (g,n,e)
        float* lg = logits.data_ptr<float>();
        for (int64_t j = 0; j < g; ++j) {
          for (int64_t r = 0; r < n; ++r) {
            const int64_t i = p0 + a + r, L = i + 1;  // the query at position i sees keys 0..i
            float* row = lg + (j * n + r) * e;
            softmax_row(row, L, cap);
            for (int64_t x = L; x < e; ++x) row[x] = 0.f;  // keys after the query: none
            if (NB > 0) {
              const int64_t b = bucket_steps > 0 ? i / bucket_steps : 0;
              if (b > last_bucket - NB) {  // older buckets were restarted by later ones: their queries left no trace
                float* col = mine + ((b % NB) * H + h) * T;
                if (count) {
                  const float thr = 1.f / static_cast<float>(L);
                  for (int64_t x = 0; x < L; ++x) col[x] += row[x] > thr ? 1.f : 0.f;
                } else {
                  for (int64_t x = 0; x < L; ++x) col[x] += row[x];
                }
              }
            }
            if (S > NB && i >= observe_from) {
              float* col = mine + (NB * H + h) * T;
              for (int64_t x = 0; x < L; ++x) col[x] += row[x];
            }
          }
        }
        torch::Tensor ctx = at::matmul(logits, v[h].narrow(0, 0, e)).contiguous();  // (g, n, D)
        const float* c = ctx.data_ptr<float>();
        for (int64_t j = 0; j < g; ++j)
          for (int64_t r = 0; r < n; ++r)
            std::copy(c + (j * n + r) * D, c + (j * n + r + 1) * D, o_p + ((a + r) * H * g + h * g + j) * D);
      }
    }
  });
  if (S == 0) return;
  float* acc_p = want_acc ? acc.data_ptr<float>() : nullptr;
  float* snap_p = want_snap ? snap.data_ptr<float>() : nullptr;
  at::parallel_for(0, S * H * T, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      float total = 0.f;
      for (int64_t w = 0; w < workers; ++w) total += sums[w * S * H * T + x];
      if (x < NB * H * T) acc_p[x] = total; else snap_p[x - NB * H * T] = total;
    }
  });
}
"""

#: Built for the machine it runs on (there, at start-up or ahead). Fast maths lets the compiler vectorise the
#: softmax's exponentials with glibc's vector maths; the operator reads no slot outside a window and starts each
#: maximum from a real logit, so it meets no infinity or NaN.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
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
    key = hashlib.sha256((_SOURCE + " ".join(_CFLAGS) + torch.__version__ + _machine()).encode())
    return f"scissorhands_paged_{key.hexdigest()[:12]}"


def operator_file():
    """Where the built operator lies (or will): ``TORCH_EXTENSIONS_DIR``/name/name.so."""
    return build_module_file(operator_name())


def _ops():
    """The compiled operator, loaded or built (:func:`.build.load`) once per process."""
    if "ops" not in _OPS:
        _OPS["ops"] = load_extension(operator_name(), _SOURCE, ["decode", "prompt"], _CFLAGS, ["-lmvec"])
    return _OPS["ops"]


def build():
    """Build (or load) the operator now, before serving; a :class:`.build.BuildError` of one line if it cannot be.
    Returns the loaded module."""
    return _ops()


_NONE = torch.empty(0)


def decode(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget: int, scale: float,
           softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None, k_scale: float = 1.0,
           v_scale: float = 1.0) -> None:
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
    """
    _ops().decode(query.float().contiguous(), kv_cache, tok, last, tables.contiguous(), bucket, restart,
                  _NONE if acc is None else acc, _NONE if out is None else out, budget, float(scale),
                  float(softcap or 0.0), bool(count), acc is not None, out is not None, LAYOUTS[layout],
                  FP8[fp8] if fp8 else 0, float(k_scale), float(v_scale))


def observe(query, kv_cache, tok, last, tables, bucket, restart, acc, budget: int, scale: float,
            softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> None:
    """:func:`decode`'s importance update alone (no output)."""
    decode(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count, layout,
           fp8, k_scale, v_scale)


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
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """:func:`decode` in plain torch, one request at a time (the tests' reference)."""
    keys, values = keys_values(kv_cache, layout, fp8, k_scale, v_scale)
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
                      softcap: float | None, count: bool, layout: str = "vec", fp8: str | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """:func:`observe` in plain torch."""
    decode_reference(query, kv_cache, tok, last, tables, bucket, restart, acc, None, budget, scale, softcap, count,
                     layout, fp8, k_scale, v_scale)
