// The attention prologue from the fused q/k/v rows (twin: kernels/qk_rope_store.py's qk_rope_store_ref):
// optional per-head RMSNorm of q and k (Qwen3), rotary (rotate-half) on q and k, k and v stored at their cache
// slots (slot -1: not stored). Rounds as the twin: cos/sin to the activation dtype, each normalised value, each
// rotary product and sum.
#include <torch/library.h>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvmesh {

// One head of d values from src (activation dtype) -> normed (optional) and rotated, written to dst.
template <typename T>
static inline void norm_rope_head(T* dst, const T* src, const T* w, const float* c, const float* s, int64_t d,
                                  float eps, float* a) {
  const int64_t half = d / 2;
  if (w != nullptr) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) {
      a[i] = Act<T>::load(src + i);
      ss += a[i] * a[i];
    }
    const float inv = 1.f / std::sqrt(ss / float(d) + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] = Act<T>::round(Act<T>::load(w + i) * Act<T>::round(a[i] * inv));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] = Act<T>::load(src + i);
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = a[i], x2 = a[half + i];
    Act<T>::store(dst + i, Act<T>::round(x1 * c[i]) - Act<T>::round(x2 * s[i]));
    Act<T>::store(dst + half + i, Act<T>::round(x2 * c[i]) + Act<T>::round(x1 * s[i]));
  }
}

at::Tensor qk_rope_store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                         double eps, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = qkv.size(0), d = head_dim, half = d / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d && qkv.stride(1) == 1 && d % 2 == 0,
              "qk_rope_store: qkv [tokens, (heads + 2 kv_heads) head_dim] with contiguous rows");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "qk_rope_store: q and k norms come together");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() && cos_sin_cache.size(1) == d,
              "qk_rope_store: cos_sin_cache [positions, head_dim] float32");
  TORCH_CHECK(positions.scalar_type() == at::kInt && slot_mapping.scalar_type() == at::kInt &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens && positions.is_contiguous() &&
                  slot_mapping.is_contiguous(), "qk_rope_store: positions and slot_mapping [tokens] int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 4 && k_cache.size(2) == kv_heads && k_cache.size(3) == d &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "qk_rope_store: caches [blocks, block_size, kv_heads, head_dim] contiguous in qkv's dtype");
  if (q_weight) {
    TORCH_CHECK(q_weight->numel() == d && k_weight->numel() == d && q_weight->is_contiguous() &&
                    k_weight->is_contiguous() && q_weight->scalar_type() == qkv.scalar_type() &&
                    k_weight->scalar_type() == qkv.scalar_type(), "qk_rope_store: norm weights [head_dim]");
  }
  at::Tensor q = at::empty({tokens, heads, d}, qkv.options());
  const int32_t* pos = positions.data_ptr<int32_t>();
  const int32_t* slots = slot_mapping.data_ptr<int32_t>();
  const float* cs = cos_sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_sin_cache.size(0), row_stride = qkv.stride(0), cache_slots = k_cache.size(0) * k_cache.size(1);
  KVMESH_DISPATCH_ACT(qkv.scalar_type(), "qk_rope_store", [&] {
    const T* src = ptr<T>(qkv);
    T* qo = ptr<T>(q);
    T* kc = ptr<T>(k_cache);
    T* vc = ptr<T>(v_cache);
    const T* qw = q_weight ? ptr<T>(*q_weight) : nullptr;
    const T* kw = k_weight ? ptr<T>(*k_weight) : nullptr;
    parallel_for(0, tokens, std::max<int64_t>(1, 64 / (heads + kv_heads)), [&](int64_t t0, int64_t t1) {
      std::vector<float> c(half), s(half), a(d);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = pos[t];
        TORCH_CHECK(p >= 0 && p < max_pos, "qk_rope_store: position ", p, " outside the rotary table");
        for (int64_t i = 0; i < half; ++i) {
          c[i] = Act<T>::round(cs[p * d + i]);
          s[i] = Act<T>::round(cs[p * d + half + i]);
        }
        const T* row = src + t * row_stride;
        for (int64_t h = 0; h < heads; ++h)
          norm_rope_head<T>(qo + (t * heads + h) * d, row + h * d, qw, c.data(), s.data(), d, float(eps), a.data());
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        TORCH_CHECK(slot < cache_slots, "qk_rope_store: slot ", slot, " outside the cache");
        for (int64_t h = 0; h < kv_heads; ++h) {
          norm_rope_head<T>(kc + (slot * kv_heads + h) * d, row + (heads + h) * d, kw, c.data(), s.data(), d,
                            float(eps), a.data());
          std::memcpy(vc + (slot * kv_heads + h) * d, row + (heads + kv_heads + h) * d, d * sizeof(T));
        }
      }
    });
  });
  return q;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("qk_rope_store(Tensor qkv, int heads, int kv_heads, int head_dim, Tensor? q_weight, Tensor? k_weight, "
        "float eps, Tensor positions, Tensor cos_sin_cache, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> Tensor");
  m.impl("qk_rope_store", c10::DispatchKey::CPU, &qk_rope_store);
}

}  // namespace kvmesh
