// The decode operator: each decoding request's new query over its window of vLLM's paged K/V, read where it lies,
// and the probabilities added to the importance accumulator of each physical slot.
#include "common.hpp"

// The fast path (float32 or bf16 K/V, N and D multiples of 16): G query heads of one KV head held in registers,
// 16 tokens (keys) or 16 dims (values) at a time, each K/V element read once for the group and converted once.

// Logits of G query heads (qs: G rows of D) for the 16 tokens t0..t0+15 of a block (t0 a multiple of 16).
template <typename T, int LAYOUT, int G>
static inline void key_tile(const T* kb, int64_t t0, int64_t N, int64_t D, const float* qs, f16v* acc) {
  for (int j = 0; j < G; ++j) acc[j] = f16v{};
  if constexpr (LAYOUT == VEC) {
    const T* k = kb + t0;
    for (int64_t d = 0; d < D; ++d) {
      const f16v kd = load16(k + d * N);
      for (int j = 0; j < G; ++j) acc[j] += qs[j * D + d] * kd;
    }
  } else {
    const T* k = kb + t0 * D;  // the tile of 16 tokens: [D/2][16][2]
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      f16v even, odd;
      load_pairs(k + d2 * 32, even, odd);
      for (int j = 0; j < G; ++j) acc[j] += qs[j * D + 2 * d2] * even + qs[j * D + 2 * d2 + 1] * odd;
    }
  }
}

// Logits of query heads j0..j0+G-1 over the window ws..p (rows of L in lg), block by block.
template <typename T, int LAYOUT, int G>
static void key_logits(const T* kv, const int32_t* tab, int64_t H, int64_t h, int64_t N, int64_t D, int64_t ws,
                       int64_t p, const float* qs, float* lg, int64_t L) {
  f16v acc[G];
  float buf[16];
  for (int64_t x0 = ws; x0 <= p;) {
    const int64_t o0 = x0 % N, o1 = std::min<int64_t>(N, o0 + (p - x0 + 1));
    const T* kb = kv + (static_cast<int64_t>(tab[x0 / N]) * H + h) * N * 2 * D;
    for (int64_t t0 = o0 & ~int64_t{15}; t0 < o1; t0 += 16) {
      key_tile<T, LAYOUT, G>(kb, t0, N, D, qs, acc);  // lanes outside o0..o1 read other slots, then are dropped
      const int64_t a = std::max(t0, o0), b = std::min(t0 + 16, o1);
      for (int j = 0; j < G; ++j) {
        std::memcpy(buf, &acc[j], sizeof buf);
        std::copy(buf + (a - t0), buf + (b - t0), lg + j * L + (x0 - ws) + (a - o0));
      }
    }
    x0 += o1 - o0;
  }
}

// The context of query heads j0..j0+G-1 (probabilities pr: G rows of L) over the range ws..p's values, 16 dims at a
// time, added to ctx (a row's window may be two ranges: its held prompt and its last tokens).
template <typename T, int LAYOUT, int G>
static void value_context(const T* kv, const int32_t* tab, int64_t H, int64_t h, int64_t N, int64_t D, int64_t ws,
                          int64_t p, const float* pr, int64_t L, float* ctx) {
  f16v acc[G];
  for (int64_t c = 0; c < D / 16; ++c) {
    for (int j = 0; j < G; ++j) std::memcpy(&acc[j], ctx + j * D + c * 16, sizeof(f16v));
    for (int64_t x0 = ws; x0 <= p;) {
      const int64_t o0 = x0 % N, o1 = std::min<int64_t>(N, o0 + (p - x0 + 1));
      const T* vb = kv + (static_cast<int64_t>(tab[x0 / N]) * H + h) * N * 2 * D + N * D;
      const float* px = pr + (x0 - ws) - o0;  // px[j * L + o]: head j's probability of the block's token o
      if constexpr (LAYOUT == VEC) {
        for (int64_t o = o0; o < o1; ++o) {
          const f16v v = load16(vb + o * D + c * 16);
          for (int j = 0; j < G; ++j) acc[j] += px[j * L + o] * v;
        }
      } else {
        // Pairs of tokens per dim: a pair with one token outside the window takes only the other's half (the
        // slot outside may hold anything, NaN included).
        const T* vc = vb + c * 16 * N;
        int64_t o = o0;
        f16v first, second;
        if (o & 1) {
          load_pairs(vc + (o / 2) * 32, first, second);
          for (int j = 0; j < G; ++j) acc[j] += px[j * L + o] * second;
          ++o;
        }
        for (; o + 1 < o1; o += 2) {
          load_pairs(vc + (o / 2) * 32, first, second);
          for (int j = 0; j < G; ++j) acc[j] += px[j * L + o] * first + px[j * L + o + 1] * second;
        }
        if (o < o1) {
          load_pairs(vc + (o / 2) * 32, first, second);
          for (int j = 0; j < G; ++j) acc[j] += px[j * L + o] * first;
        }
      }
      x0 += o1 - o0;
    }
    for (int j = 0; j < G; ++j) std::memcpy(ctx + j * D + c * 16, &acc[j], sizeof(f16v));
  }
}

// A range lo..hi of a row's positions whose logits start at column off of the row.
struct Span {
  int64_t lo, hi, off;
};

template <typename T, int LAYOUT>
static constexpr bool has_fast_path() {
  return std::is_same_v<T, c10::BFloat16> || (std::is_same_v<T, float> && LAYOUT == VEC);
}

template <typename T, int LAYOUT>
static void decode_impl(const torch::Tensor& query, const torch::Tensor& kv_cache, const torch::Tensor& tok,
                        const torch::Tensor& last, const torch::Tensor& tables, const torch::Tensor& bucket,
                        const torch::Tensor& restart, torch::Tensor& acc, torch::Tensor& out, int64_t budget,
                        const torch::Tensor& held, double scale, double softcap, bool count, bool want_acc,
                        bool want_out, const float* lut, float k_scale, float v_scale) {
  const int64_t R = tok.size(0), H = kv_cache.size(1), N = kv_cache.size(2), D = kv_cache.size(3) / 2;
  const int64_t Hq = query.size(1), g = Hq / H, nb = kv_cache.size(0), maxblk = tables.size(1);
  const float* q = query.data_ptr<float>();
  const T* kv = kv_cache.data_ptr<T>();
  const int64_t* tok_p = tok.data_ptr<int64_t>();
  const int64_t* last_p = last.data_ptr<int64_t>();
  const int64_t* bucket_p = bucket.data_ptr<int64_t>();
  const bool* restart_p = restart.data_ptr<bool>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t* held_p = held.numel() ? held.data_ptr<int64_t>() : nullptr;
  float* a = want_acc ? acc.data_ptr<float>() : nullptr;
  float* o_p = want_out ? out.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const bool fast = has_fast_path<T, LAYOUT>() && N % 16 == 0 && D % 16 == 0;
  at::parallel_for(0, R * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> logits, contrib, qs(g * D), ctx(g * D);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / H, h = rh % H, p = last_p[r];
      // The window: the last ``budget`` positions, after a held prompt of P positions that it also attends
      // (keep-prompt; P = 0 otherwise). Logit and probability rows hold the prompt first, then the window.
      const int64_t P = held_p ? held_p[r] : 0;
      const int64_t ws = std::max<int64_t>(P, p - budget + 1), L = P + (p - ws + 1);
      Span spans[2];
      int ns = 0;
      if (P > 0) spans[ns++] = Span{0, P - 1, 0};
      spans[ns++] = Span{ws, p, P};
      const int32_t* row_tab = tab + r * maxblk;
      logits.assign(g * L, 0.f);
      const float* qr = q + (tok_p[r] * Hq + h * g) * D;
      for (int64_t i = 0; i < g * D; ++i) qs[i] = qr[i] * sc * k_scale;  // K's scale, once
      if constexpr (has_fast_path<T, LAYOUT>()) {
        if (fast) {
          for (int64_t j0 = 0; j0 < g; j0 += MAX_G) {
            for (int si = 0; si < ns; ++si) {
              const Span sp = spans[si];
              by_group(std::min(MAX_G, g - j0), [&](auto G) {
                key_logits<T, LAYOUT, decltype(G)::value>(kv, row_tab, H, h, N, D, sp.lo, sp.hi, qs.data() + j0 * D,
                                                          logits.data() + j0 * L + sp.off, L);
              });
            }
          }
        }
      }
      if (!fast) {
        // Logits, block by block: each block's keys are read once for the group's query heads.
        for (int si = 0; si < ns; ++si) {
        const int64_t lo = spans[si].lo, hi = spans[si].hi, off = spans[si].off;
        for (int64_t x0 = lo; x0 <= hi;) {
          const int64_t o0 = x0 % N, o1 = std::min<int64_t>(N, o0 + (hi - x0 + 1));
          const T* kb = kv + (static_cast<int64_t>(row_tab[x0 / N]) * H + h) * N * 2 * D;
          if (LAYOUT == VEC) {
            for (int64_t d = 0; d < D; ++d) {
              const T* kd = kb + d * N;
              for (int64_t j = 0; j < g; ++j) {
                const float qd = qs[j * D + d];
                float* lg = logits.data() + j * L + off + (x0 - lo) - o0;
                for (int64_t o = o0; o < o1; ++o) lg[o] += qd * load(kd[o], lut);
              }
            }
          } else {
            for (int64_t o = o0; o < o1; ++o) {
              for (int64_t j = 0; j < g; ++j) {
                const float* qj = qs.data() + j * D;
                float s = 0.f;
                for (int64_t d = 0; d < D; ++d) s += qj[d] * load(kb[k_at<LAYOUT>(o, d, N, D)], lut);
                logits[j * L + off + (x0 - lo) + (o - o0)] = s;
              }
            }
          }
          x0 += o1 - o0;
        }
        }
      }
      // Softmax per query head (after the soft cap), in place: logits become probabilities.
      for (int64_t j = 0; j < g; ++j) softmax_row(logits.data() + j * L, L, cap);
      if (want_out) {  // the context: probabilities times values, read where they lie
        std::fill(ctx.begin(), ctx.end(), 0.f);
        if constexpr (has_fast_path<T, LAYOUT>()) {
          if (fast) {
            for (int64_t j0 = 0; j0 < g; j0 += MAX_G) {
              for (int si = 0; si < ns; ++si) {
                const Span sp = spans[si];
                by_group(std::min(MAX_G, g - j0), [&](auto G) {
                  value_context<T, LAYOUT, decltype(G)::value>(kv, row_tab, H, h, N, D, sp.lo, sp.hi,
                                                               logits.data() + j0 * L + sp.off, L,
                                                               ctx.data() + j0 * D);
                });
              }
            }
          }
        }
        if (!fast) {
          for (int si = 0; si < ns; ++si)
          for (int64_t x = spans[si].lo; x <= spans[si].hi; ++x) {
            const T* vb = kv + (static_cast<int64_t>(row_tab[x / N]) * H + h) * N * 2 * D;
            const int64_t off = x % N;
            for (int64_t j = 0; j < g; ++j) {
              const float pj = logits[j * L + spans[si].off + (x - spans[si].lo)];
              float* cj = ctx.data() + j * D;
              if (LAYOUT == VEC) {
                const T* vr = vb + N * D + off * D;
                for (int64_t d = 0; d < D; ++d) cj[d] += pj * load(vr[d], lut);
              } else {
                for (int64_t d = 0; d < D; ++d) cj[d] += pj * load(vb[v_at<LAYOUT>(off, d, N, D)], lut);
              }
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
        for (int si = 0; si < ns; ++si) {
          for (int64_t x = spans[si].lo; x <= spans[si].hi; ++x) {
            float* slot = ab + (static_cast<int64_t>(row_tab[x / N]) * H + h) * N + x % N;
            if (restart_p[r] || x == p) *slot = 0.f;  // a bucket that starts now; the new token's fresh slot
            *slot += contrib[spans[si].off + x - spans[si].lo];
          }
        }
      }
    }
  });
}

template <typename T>
static void dispatch_layout(int64_t layout, const torch::Tensor& query, const torch::Tensor& kv_cache,
                            const torch::Tensor& tok, const torch::Tensor& last, const torch::Tensor& tables,
                            const torch::Tensor& bucket, const torch::Tensor& restart, torch::Tensor& acc,
                            torch::Tensor& out, int64_t budget, const torch::Tensor& held, double scale,
                            double softcap, bool count, bool want_acc, bool want_out, const float* lut,
                            float k_scale, float v_scale) {
  if (layout == VEC) {
    decode_impl<T, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, held, scale, softcap,
                        count, want_acc, want_out, lut, k_scale, v_scale);
  } else {
    TORCH_CHECK(sizeof(T) <= 2, "the amx layout holds 2-byte or fp8 K/V");
    decode_impl<T, AMX>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, held, scale, softcap,
                        count, want_acc, want_out, lut, k_scale, v_scale);
  }
}

// fp8: 0 none, 1 e4m3 (vLLM's "fp8" and "fp8_e4m3"), 2 e5m2; the bytes' values are multiplied by the scales.
void decode(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor tok, torch::Tensor last,
            torch::Tensor tables, torch::Tensor bucket, torch::Tensor restart, torch::Tensor acc, torch::Tensor out,
            int64_t budget, torch::Tensor held, double scale, double softcap, bool count, bool want_acc, bool want_out,
            int64_t layout,
            int64_t fp8, double k_scale, double v_scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.is_contiguous(), "query: float32, contiguous");
  TORCH_CHECK(!want_acc || (acc.scalar_type() == torch::kFloat32 && acc.is_contiguous()), "acc: float32, contiguous");
  TORCH_CHECK(!want_out || (out.scalar_type() == torch::kFloat32 && out.is_contiguous()), "out: float32, contiguous");
  TORCH_CHECK(kv_cache.is_contiguous() && tables.scalar_type() == torch::kInt32 && tables.is_contiguous(),
              "kv_cache and tables: contiguous, tables int32");
  TORCH_CHECK(layout == VEC || layout == AMX, "layout: 0 (vec) or 1 (amx)");
  TORCH_CHECK(held.numel() == 0 || (held.scalar_type() == torch::kLong && held.numel() == tok.numel()),
              "held: empty, or int64 (R,)");
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
    dispatch_layout<uint8_t>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, held, scale,
                             softcap, count, want_acc, want_out, lut.data(), ks, vs);
  } else if (dtype == torch::kFloat32) {
    TORCH_CHECK(layout == VEC, "the amx layout holds 2-byte or fp8 K/V");
    decode_impl<float, VEC>(query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, held, scale, softcap,
                            count, want_acc, want_out, nullptr, ks, vs);
  } else if (dtype == torch::kBFloat16) {
    dispatch_layout<c10::BFloat16>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget,
                                   held, scale, softcap, count, want_acc, want_out, nullptr, ks, vs);
  } else if (dtype == torch::kFloat16) {
    dispatch_layout<c10::Half>(layout, query, kv_cache, tok, last, tables, bucket, restart, acc, out, budget, held, scale,
                               softcap, count, want_acc, want_out, nullptr, ks, vs);
  } else {
    TORCH_CHECK(false, "kv_cache: float32, bfloat16, float16, or uint8 holding fp8");
  }
}
