// The prompt operator: a prompt attended once, exactly and causally, with what the core's prompt-aware
// prefill records from it.
#include "common.hpp"

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
