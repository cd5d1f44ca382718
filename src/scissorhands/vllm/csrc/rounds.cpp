// The rounds operator: one step's rounds for every layer at once. Per (layer, rounding row, KV head): the drop
// lowest-scoring tokens of the window (the core's selection.lowest) and their swap into the window's leaving
// slots, K/V, positions and importance moved together.
#include "common.hpp"

// Copy the K/V elements of physical slots src[i] -> dst[i] (i < n) of one KV head, all reads before any write.
template <typename E, int LAYOUT>
static void move_kv(E* kv, int64_t H, int64_t h, int64_t N, int64_t D, const int64_t* src, const int64_t* dst,
                    int64_t n, std::vector<E>& buf) {
  buf.resize(n * 2 * D);
  for (int pass = 0; pass < 2; ++pass) {
    const int64_t* slots = pass == 0 ? src : dst;
    for (int64_t i = 0; i < n; ++i) {
      E* region = kv + ((slots[i] / N) * H + h) * N * 2 * D;
      const int64_t o = slots[i] % N;
      E* held = buf.data() + i * 2 * D;
      for (int64_t d = 0; d < D; ++d) {
        E& k = region[k_at<LAYOUT>(o, d, N, D)];
        E& v = region[v_at<LAYOUT>(o, d, N, D)];
        if (pass == 0) {
          held[d] = k;
          held[D + d] = v;
        } else {
          k = held[d];
          v = held[D + d];
        }
      }
    }
  }
}

// A score as an integer of the same order (the operators build with fast maths, under which the compiler may
// assume no NaN or infinity, so no float comparison decides here): -0 as +0, NaN above +inf, or below everything
// where ``nan_low``.
static inline int64_t ordered(double x, bool nan_low) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint64_t magnitude = u & 0x7fffffffffffffffULL;
  if (magnitude > 0x7ff0000000000000ULL) return nan_low ? INT64_MIN : INT64_MAX;
  if (magnitude == 0) return 0;
  const int64_t s = static_cast<int64_t>(u);
  return s >= 0 ? s : s ^ INT64_MAX;  // negative: larger magnitudes lower
}

// Which logical slots (indices into the window) are the drop victims of one row and head, oldest first:
// ``lowest`` (the recent window and shielded slots scored +inf; a stable ascending sort, so the older of equal
// scores goes first), given scores in position order and ``order`` (each position-order index's logical slot).
// One victim is torch's argmin (lowest's shortcut), which takes the first NaN as the minimum; more are its stable
// sort, which puts NaN after everything.
static void victims(const double* score, const int64_t* order, const bool* shield, int64_t B, int64_t recent,
                    int64_t m, std::vector<int64_t>& rank, std::vector<int64_t>& key, std::vector<char>& chosen,
                    int64_t* out) {
  const int64_t fenced_key = ordered(HUGE_VAL, false);
  key.resize(B);
  rank.resize(B);
  chosen.assign(B, 0);
  for (int64_t j = 0; j < B; ++j) {
    const bool fenced = j >= B - recent || (shield != nullptr && shield[j]);
    key[j] = fenced ? fenced_key : ordered(score[j], m == 1);
    rank[j] = j;
  }
  std::stable_sort(rank.begin(), rank.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  for (int64_t i = 0; i < m; ++i) chosen[rank[i]] = 1;
  int64_t k = 0;
  for (int64_t j = 0; j < B && k < m; ++j)
    if (chosen[j]) out[k++] = order[j];
}

template <typename E, int LAYOUT>
static void rounds_impl(std::vector<torch::Tensor>& caches, torch::Tensor& pos, torch::Tensor& acc, bool want_acc,
                        const torch::Tensor& window, const torch::Tensor& scores, const torch::Tensor& order,
                        const torch::Tensor& shield, bool want_shield, int64_t recent, int64_t m) {
  const int64_t nl = static_cast<int64_t>(caches.size()), rr = window.size(0), B = window.size(1);
  const int64_t nb = caches[0].size(0), H = caches[0].size(1), N = caches[0].size(2), D = caches[0].size(3) / 2;
  const int64_t NB = want_acc ? acc.size(1) : 0, S = nb * N;
  std::vector<E*> kv(nl);
  for (int64_t l = 0; l < nl; ++l) kv[l] = reinterpret_cast<E*>(caches[l].data_ptr());
  const int64_t* win = window.data_ptr<int64_t>();
  const double* sc = scores.data_ptr<double>();
  const int64_t* ord = order.data_ptr<int64_t>();
  const bool* sh = want_shield ? shield.data_ptr<bool>() : nullptr;
  int32_t* pos_p = pos.data_ptr<int32_t>();
  float* acc_p = want_acc ? acc.data_ptr<float>() : nullptr;
  // Rows of different requests hold different physical slots, and layers and heads their own memory: each
  // (layer, row, head) moves alone.
  at::parallel_for(0, nl * rr * H, 8, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rank, key, vlog(m), src(2 * m), dst(2 * m);
    std::vector<char> chosen, isv(B);
    std::vector<E> buf;
    std::vector<int32_t> held_pos(2 * m);
    std::vector<float> held_acc(2 * m * std::max<int64_t>(NB, 1));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / H, h = item % H, l = row / rr, r = row % rr;  // row: layer * rr + r
      const int64_t at = (row * H + h) * B;
      victims(sc + at, ord + at, sh == nullptr ? nullptr : sh + at, B, recent, m, rank, key, chosen, vlog.data());
      // The victims, oldest first, go to the leaving slots 0..m-1; the kept tokens found there go to the
      // victims' slots outside them, both in slot order.
      std::fill(isv.begin(), isv.end(), 0);
      for (int64_t k = 0; k < m; ++k) isv[vlog[k]] = 1;
      int64_t n = 0;
      for (int64_t k = 0; k < m; ++k) {
        src[n] = vlog[k];
        dst[n++] = k;
      }
      int64_t f = m;
      for (int64_t i = 0; i < m; ++i) {
        if (isv[i]) continue;  // a victim already leaving
        while (!isv[f]) ++f;
        src[n] = i;
        dst[n++] = f++;
      }
      const int64_t* w = win + r * B;
      for (int64_t i = 0; i < n; ++i) {
        src[i] = w[src[i]];
        dst[i] = w[dst[i]];
      }
      move_kv<E, LAYOUT>(kv[l], H, h, N, D, src.data(), dst.data(), n, buf);
      int32_t* pl = pos_p + l * S * H;
      for (int64_t i = 0; i < n; ++i) held_pos[i] = pl[src[i] * H + h];
      for (int64_t i = 0; i < n; ++i) pl[dst[i] * H + h] = held_pos[i];
      for (int64_t b = 0; b < NB; ++b) {
        float* ab = acc_p + (l * NB + b) * nb * H * N;
        auto at_slot = [&](int64_t s) -> float& { return ab[((s / N) * H + h) * N + s % N]; };
        for (int64_t i = 0; i < n; ++i) held_acc[i] = at_slot(src[i]);
        for (int64_t i = 0; i < n; ++i) at_slot(dst[i]) = held_acc[i];
      }
    }
  });
}

template <int LAYOUT>
static void rounds_by_size(int64_t size, std::vector<torch::Tensor>& caches, torch::Tensor& pos, torch::Tensor& acc,
                           bool want_acc, const torch::Tensor& window, const torch::Tensor& scores,
                           const torch::Tensor& order, const torch::Tensor& shield, bool want_shield, int64_t recent,
                           int64_t m) {
  if (size == 1) rounds_impl<uint8_t, LAYOUT>(caches, pos, acc, want_acc, window, scores, order, shield, want_shield,
                                              recent, m);
  else if (size == 2) rounds_impl<uint16_t, LAYOUT>(caches, pos, acc, want_acc, window, scores, order, shield,
                                                    want_shield, recent, m);
  else rounds_impl<uint32_t, LAYOUT>(caches, pos, acc, want_acc, window, scores, order, shield, want_shield, recent,
                                     m);
}

// caches: L layers' (num_blocks, H_kv, N, 2D) caches, one shape and dtype; pos (L, num_blocks * N, H_kv) int32;
// acc (L, NB, num_blocks, H_kv, N) float32 (want_acc); window (Rr, B) int64, the rounding rows' physical slots
// oldest first; scores (L * Rr, H_kv, B) float64 in position order, order (L * Rr, H_kv, B) int64 the logical slot
// of each, shield (L * Rr, H_kv, B) bool (want_shield); recent, drop as the layers' own.
void rounds(std::vector<torch::Tensor> caches, int64_t layout, torch::Tensor pos, torch::Tensor acc, bool want_acc,
            torch::Tensor window, torch::Tensor scores, torch::Tensor order, torch::Tensor shield, bool want_shield,
            int64_t recent, int64_t drop) {
  TORCH_CHECK(!caches.empty(), "caches: one per layer");
  const auto& first = caches[0];
  for (const auto& c : caches)
    TORCH_CHECK(c.is_contiguous() && c.sizes() == first.sizes() && c.scalar_type() == first.scalar_type(),
                "caches: contiguous, one shape and dtype");
  const int64_t nl = static_cast<int64_t>(caches.size()), H = first.size(1), N = first.size(2);
  const int64_t rr = window.size(0), B = window.size(1), size = first.element_size();
  TORCH_CHECK(layout == VEC || (layout == AMX && size <= 2), "layout: 0 (vec), or 1 (amx) for 2-byte or fp8 K/V");
  TORCH_CHECK(window.scalar_type() == torch::kLong && window.is_contiguous() && window.dim() == 2, "window: (Rr, B) int64");
  TORCH_CHECK(pos.scalar_type() == torch::kInt && pos.is_contiguous() && pos.dim() == 3 && pos.size(0) == nl &&
                  pos.size(1) == first.size(0) * N && pos.size(2) == H,
              "pos: (L, num_blocks * N, H_kv) int32, contiguous");
  TORCH_CHECK(!want_acc || (acc.scalar_type() == torch::kFloat && acc.is_contiguous() && acc.dim() == 5 &&
                            acc.size(0) == nl && acc.size(2) == first.size(0) && acc.size(3) == H && acc.size(4) == N),
              "acc: (L, NB, num_blocks, H_kv, N) float32, contiguous");
  const std::vector<int64_t> rows{nl * rr, H, B};
  TORCH_CHECK(scores.scalar_type() == torch::kDouble && scores.is_contiguous() && scores.sizes() == rows,
              "scores: (L * Rr, H_kv, B) float64, contiguous");
  TORCH_CHECK(order.scalar_type() == torch::kLong && order.is_contiguous() && order.sizes() == rows,
              "order: (L * Rr, H_kv, B) int64, contiguous");
  TORCH_CHECK(!want_shield || (shield.scalar_type() == torch::kBool && shield.is_contiguous() && shield.sizes() == rows),
              "shield: (L * Rr, H_kv, B) bool, contiguous");
  TORCH_CHECK(drop >= 1 && drop <= B && recent >= 0, "drop: 1 to B");
  if (layout == VEC)
    rounds_by_size<VEC>(size, caches, pos, acc, want_acc, window, scores, order, shield, want_shield, recent, drop);
  else
    rounds_by_size<AMX>(size, caches, pos, acc, want_acc, window, scores, order, shield, want_shield, recent, drop);
}
