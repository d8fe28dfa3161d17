// RMSNorm and residual-add + RMSNorm over rows (twin: kernels/rmsnorm.py's rms_norm_ref / add_rms_norm_ref).
// Rounding as the twin: the residual sum rounds to the activation dtype, the normalised value rounds before
// the weight multiply, the product rounds; the sum of squares is float32.
#include <torch/library.h>
#include <vector>

#include "common.h"
#include "ops.h"

namespace kvmesh {

template <typename T>
static void norm_rows(T* out, T* x, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  // One row is ~1 us of work: split rows across threads only when there are many.
  parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * n;
      float ss = 0.f;
      if (res != nullptr) {
        T* rr = res + r * n;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          float s = Act<T>::round(Act<T>::load(xr + i) + Act<T>::load(rr + i));
          Act<T>::store(rr + i, s);
          buf[i] = s;
          ss += s * s;
        }
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          float s = Act<T>::load(xr + i);
          buf[i] = s;
          ss += s * s;
        }
      }
      const float inv = 1.f / std::sqrt(ss / float(n) + eps);
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        Act<T>::store(o + i, Act<T>::load(w + i) * Act<T>::round(buf[i] * inv));
    }
  });
}

void rms_norm_into(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                   const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous rows only");
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type(), "rms_norm: weight [", n, "] in x's dtype");
  TORCH_CHECK(out.numel() == x.numel() && out.scalar_type() == x.scalar_type(), "rms_norm: out like x");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->numel() == x.numel() &&
                    residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
  }
  KVMESH_DISPATCH_ACT(x.scalar_type(), "rms_norm", [&] {
    norm_rows<T>(ptr<T>(out), ptr<T>(x), residual ? ptr<T>(*residual) : nullptr, ptr<T>(weight), rows, n,
                 float(eps));
  });
}

static at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm_into(out, x, std::nullopt, weight, eps);
  return out;
}

// In place, as the Triton kernel: residual <- x + residual, x <- rms_norm(residual).
static void add_rms_norm_op(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  rms_norm_into(x, x, residual, weight, eps);
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm_op);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm_op);
}

}  // namespace kvmesh
