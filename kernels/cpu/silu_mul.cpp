// silu(gate) * up for x = [gate | up] rows (twin: kernels/silu_mul.py's silu_mul_ref): silu rounds to the
// activation dtype, then the product does; the arithmetic is float32.
#include <torch/library.h>

#include "common.h"
#include "ops.h"

namespace kvmesh {

template <typename T>
static void silu_mul_rows(T* out, const T* x, int64_t rows, int64_t n) {
  parallel_for(0, rows * n, 16384, [&](int64_t a, int64_t b) {
    for (int64_t e = a; e < b;) {
      const int64_t r = e / n, c0 = e % n, c1 = std::min<int64_t>(n, c0 + (b - e));
      const T* g = x + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) {
        const float gv = Act<T>::load(g + c);
        const float act = Act<T>::round(gv / (1.f + fast_exp(-gv)));
        Act<T>::store(o + c, act * Act<T>::load(u + c));
      }
      e += c1 - c0;
    }
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0 && x.is_contiguous(), "silu_mul: x [tokens, 2 * inter] contiguous");
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  KVMESH_DISPATCH_ACT(x.scalar_type(), "silu_mul", [&] { silu_mul_rows<T>(ptr<T>(out), ptr<T>(x), rows, n); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("silu_mul(Tensor x) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}

}  // namespace kvmesh
