// Attention of query rows over the paged KV cache (twins: kernels/decode_attention.py's decode_attention_ref for
// the decode rows, kernels/extend_attention.py's extend_attention_ref for prompt-chunk rows). One task per
// (row, KV head) computes all of that KV head's query heads, reading each key and value once. Scores and
// softmax in float32, probabilities rounded to the activation dtype before the product with V (the twin's
// bmm numerics), the output accumulated in float32 and rounded once.
#include <torch/library.h>
#include <memory>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvmesh {

template <typename T>
static void attend(T* out, const T* q, const T* kc, const T* vc, const int32_t* tables, int64_t table_stride,
                   const int64_t* row_table, const int64_t* row_end, const bool* flash_row, int64_t rows, int64_t heads, int64_t kv_heads,
                   int64_t d, int64_t block_size, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, row_end[r]);
  // A task is ~longest * group * d multiply-adds twice: below ~64k of them per chunk a thread's wake-up costs more.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, longest * group * d));
  parallel_for(0, rows * kv_heads, grain, [&](int64_t a, int64_t b) {
    std::vector<float> qf(group * d), acc(group * d), inv_sum(group), scores(group * std::max<int64_t>(longest, 1));
    for (int64_t task = a; task < b; ++task) {
      const int64_t r = task / kv_heads, kh = task % kv_heads;
      const int64_t end = row_end[r], start = window > 0 ? std::max<int64_t>(0, end - window) : 0, n = end - start;
      const int32_t* table = tables + row_table[r] * table_stride;
      const T* qr = q + (r * heads + kh * group) * d;
      for (int64_t i = 0; i < group * d; ++i) qf[i] = Act<T>::load(qr + i);
      // Block by block (no division per key): keys [lo, hi) of block b sit at consecutive slots.
      for (int64_t b = start / block_size; b * block_size < end; ++b) {
        const int64_t lo = std::max(start, b * block_size), hi = std::min(end, (b + 1) * block_size);
        const T* k = kc + ((int64_t(table[b]) * block_size + lo - b * block_size) * kv_heads + kh) * d;
        const int64_t ks = kv_heads * d;  // from one key to the next
        int64_t t = lo;
        // Four keys at a time: four independent sums per query head (one sum alone is a chain of dependent
        // multiply-adds, each waiting on the last), each summed as the one-key loop below sums it.
        for (; t + 4 <= hi; t += 4, k += 4 * ks) {
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
            for (int64_t i = 0; i < d; ++i) {
              d0 += qg[i] * Act<T>::load(k + i);
              d1 += qg[i] * Act<T>::load(k + ks + i);
              d2 += qg[i] * Act<T>::load(k + 2 * ks + i);
              d3 += qg[i] * Act<T>::load(k + 3 * ks + i);
            }
            float* sg = scores.data() + g * n + (t - start);
            sg[0] = d0 * scale;
            sg[1] = d1 * scale;
            sg[2] = d2 * scale;
            sg[3] = d3 * scale;
          }
        }
        for (; t < hi; ++t, k += ks) {
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qg[i] * Act<T>::load(k + i);
            scores[g * n + (t - start)] = dot * scale;
          }
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const bool flash = flash_row != nullptr && flash_row[r];
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          sg[j] = fast_exp(sg[j] - mx);
          sum += sg[j];
        }
        const float inv = 1.f / sum;
        // flash: torch's CPU flash kernel (the twin's call for a decode row alone): the unnormalised exps rounded
        // for the product with V, the sum of the unrounded ones divided out at the end.
        inv_sum[g] = flash ? inv : 1.f;
        for (int64_t j = 0; j < n; ++j) sg[j] = Act<T>::round(flash ? sg[j] : sg[j] * inv);
      }
      for (int64_t b = start / block_size; b * block_size < end; ++b) {
        const int64_t lo = std::max(start, b * block_size), hi = std::min(end, (b + 1) * block_size);
        const T* v = vc + ((int64_t(table[b]) * block_size + lo - b * block_size) * kv_heads + kh) * d;
        for (int64_t t = lo; t < hi; ++t, v += kv_heads * d) {
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * n + (t - start)];
            float* ag = acc.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += p * Act<T>::load(v + i);
          }
        }
      }
      T* o = out + (r * heads + kh * group) * d;
      for (int64_t i = 0; i < group * d; ++i) Act<T>::store(o + i, acc[i] * inv_sum[i / d]);
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           int64_t num_prefill_tokens, const at::Tensor& query_start,
                           const at::Tensor& prefill_context_lens, const at::Tensor& prefill_block_tables,
                           const at::Tensor& decode_context_lens, const at::Tensor& decode_block_tables, double scale,
                           int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "paged_attention: q [tokens, heads, head_dim] contiguous");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(3) == d && heads % k_cache.size(2) == 0 &&
                  k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_attention: caches [blocks, block_size, kv_heads, head_dim] contiguous in q's dtype");
  for (const at::Tensor* t : {&query_start, &prefill_context_lens, &prefill_block_tables, &decode_context_lens,
                              &decode_block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "paged_attention: int32 contiguous metadata");
  const int64_t prefills = prefill_context_lens.numel(), decodes = decode_context_lens.numel();
  TORCH_CHECK(rows == num_prefill_tokens + decodes, "paged_attention: ", rows, " rows vs ", num_prefill_tokens,
              " prompt-chunk rows + ", decodes, " decode rows");
  const int64_t block_size = k_cache.size(1), blocks = k_cache.size(0);
  // One block table for both kinds of rows: the decode table's rows after the prefill table's (a copy of a few
  // hundred ints), and each row's end (exclusive key position: causal within a chunk).
  const int64_t width = std::max(prefill_block_tables.dim() == 2 ? prefill_block_tables.size(1) : 0,
                                 decode_block_tables.dim() == 2 ? decode_block_tables.size(1) : 0);
  std::vector<int32_t> tables((prefills + decodes) * std::max<int64_t>(width, 1), 0);
  std::vector<int64_t> row_table(rows), row_end(rows), row_width(rows);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* pctx = prefill_context_lens.data_ptr<int32_t>();
  const int32_t* dctx = decode_context_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < prefills; ++s) {
    const int64_t w = prefill_block_tables.size(1);
    std::memcpy(&tables[s * width], prefill_block_tables.data_ptr<int32_t>() + s * w, w * sizeof(int32_t));
    const int64_t n = qs[s + 1] - qs[s];
    for (int64_t j = 0; j < n; ++j) {
      row_table[qs[s] + j] = s;
      row_end[qs[s] + j] = pctx[s] - (n - 1 - j);
      row_width[qs[s] + j] = w;
    }
  }
  TORCH_CHECK(prefills == 0 || qs[prefills] == num_prefill_tokens, "paged_attention: query_start vs row count");
  for (int64_t s = 0; s < decodes; ++s) {
    const int64_t w = decode_block_tables.size(1);
    std::memcpy(&tables[(prefills + s) * width], decode_block_tables.data_ptr<int32_t>() + s * w, w * sizeof(int32_t));
    row_table[num_prefill_tokens + s] = prefills + s;
    row_end[num_prefill_tokens + s] = dctx[s];
    row_width[num_prefill_tokens + s] = w;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t used = (row_end[r] + block_size - 1) / block_size;  // entries past these are never read
    TORCH_CHECK(row_end[r] > 0 && used <= row_width[r], "paged_attention: row ", r, " attends to ", row_end[r],
                " tokens over ", row_width[r], " blocks of its table");
    for (int64_t j = 0; j < used; ++j) {
      const int32_t b = tables[row_table[r] * width + j];
      TORCH_CHECK(b >= 0 && b < blocks, "paged_attention: block ", b, " outside the cache");
    }
  }
  // The twin computes a decode row whose length group holds only itself with torch's flash kernel, other decode
  // rows with matmuls (kernels/decode_attention.py); a lone decode row is such a group, and its numerics are
  // followed here (reduced-precision activations only: in float32 there is no rounding to follow).
  std::unique_ptr<bool[]> flash(new bool[std::max<int64_t>(rows, 1)]());
  if (decodes == 1 && q.scalar_type() != at::kFloat) flash[num_prefill_tokens] = true;
  at::Tensor out = at::empty_like(q);
  KVMESH_DISPATCH_ACT(q.scalar_type(), "paged_attention", [&] {
    attend<T>(ptr<T>(out), ptr<T>(q), ptr<T>(k_cache), ptr<T>(v_cache), tables.data(), std::max<int64_t>(width, 1),
              row_table.data(), row_end.data(), flash.get(), rows, heads, k_cache.size(2), d, block_size, float(scale),
              sliding_window);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, int num_prefill_tokens, Tensor query_start, "
        "Tensor prefill_context_lens, Tensor prefill_block_tables, Tensor decode_context_lens, "
        "Tensor decode_block_tables, float scale, int sliding_window) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}

}  // namespace kvmesh
