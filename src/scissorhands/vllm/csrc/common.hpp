// What the operators share: vLLM's CPU K/V layouts, an element read as float, a softmax row, 16-float vectors.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
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

// 16 floats as one vector of the compiler's (GCC and Clang vector extensions): one AVX-512 register, two AVX2
// ones, or scalar code, whatever the build machine has (-march=native). bf16 becomes float exactly by a shift of
// its 16 bits into the high half of a 32-bit lane, so K and V stay bf16 in memory and every product and sum is
// float32.
typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

template <typename T>
static inline f16v load16(const T* p);

template <>
inline f16v load16<float>(const float* p) {
  f16v x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

template <>
inline f16v load16<c10::BFloat16>(const c10::BFloat16* p) {
  h16v h;
  std::memcpy(&h, p, sizeof h);
  const u16v w = __builtin_convertvector(h, u16v) << 16;
  f16v x;
  std::memcpy(&x, &w, sizeof x);
  return x;
}

// 16 pairs of bf16 (32 consecutive elements, as vLLM's AMX tiles hold them): the first and the second of each pair
// as floats.
static inline void load_pairs(const c10::BFloat16* p, f16v& first, f16v& second) {
  u16v w;
  std::memcpy(&w, p, sizeof w);
  const u16v a = w << 16, b = w & 0xFFFF0000u;
  std::memcpy(&first, &a, sizeof first);
  std::memcpy(&second, &b, sizeof second);
}

// fn(std::integral_constant<int, G>{}) for 1 <= G <= 8 (a register block of G query heads).
template <typename Fn>
static inline void by_group(int64_t G, Fn&& fn) {
  switch (G) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
    default: fn(std::integral_constant<int, 8>{}); break;
  }
}
constexpr int64_t MAX_G = 8;
