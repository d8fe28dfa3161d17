// Float32 activations times 16-bit weights (bfloat16 or float16) for CPUs without native bf16 matmuls: the weights
// stay in memory at 2 bytes each and are widened to float32 in registers (a bf16 is the top half of a float32; an
// fp16 goes through F16C's vcvtph2ps), so a memory-bound decode step reads half the bytes of a float32 model.
// Twin: kernels/cpu/gemv_bf16.py's linear_w16_ref (F.linear on the weight converted to float32); the sums differ
// only in float32 summation order.
#include <torch/library.h>

#include "gemv.h"
#include "ops.h"

namespace kvmesh {
namespace {

template <bool kHalf>
inline float w16_scalar(uint16_t v) {
  if constexpr (kHalf) {
    return float(c10::Half(v, c10::Half::from_bits()));
  } else {
    return bf16_to_float(v);
  }
}

#ifdef KVMESH_GEMV_AVX2
template <bool kHalf>
inline __m256 w16_load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kHalf) {
#ifdef __F16C__
    return _mm256_cvtph_ps(raw);
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = w16_scalar<true>(p[i]);
    return _mm256_load_ps(f);
#endif
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <bool kHalf>
inline __m512 w16_load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kHalf) {
    return _mm512_cvtph_ps(raw);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}
#endif

// out[r * ldo] = dot(w[0:K], x[r * ldx + 0:K]) for r < RB.
template <bool kHalf, int RB>
inline void w16_rows(const uint16_t* w, const float* x, int64_t ldx, int64_t K, float* out, int64_t ldo) {
  float s[RB];
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  {
    __m512 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      const __m512 w0 = w16_load16<kHalf>(w + k), w1 = w16_load16<kHalf>(w + k + 16);
      for (int r = 0; r < RB; ++r) {
        acc[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + k + 16), acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) s[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
#elif defined(KVMESH_GEMV_AVX2)
  {
    __m256 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = w16_load8<kHalf>(w + k), w1 = w16_load8<kHalf>(w + k + 8);
      for (int r = 0; r < RB; ++r) {
        acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) s[r] = gemv::hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
#else
  for (int r = 0; r < RB; ++r) s[r] = 0.f;
#endif
  for (; k < K; ++k) {
    const float wv = w16_scalar<kHalf>(w[k]);
    for (int r = 0; r < RB; ++r) s[r] += wv * x[r * ldx + k];
  }
  for (int r = 0; r < RB; ++r) out[r * ldo] = s[r];
}

template <bool kHalf>
at::Tensor run(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* wp = ptr<uint16_t>(w);
  const float* xp = x.data_ptr<float>();
  if (M > gemv::kMaxRows) {
    return gemv::tiled(x, N, K, [&](int64_t n0, int64_t n1, float* dst) {
      for (int64_t i = 0; i < (n1 - n0) * K; ++i) dst[i] = w16_scalar<kHalf>(wp[n0 * K + i]);
    });
  }
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  gemv::over_rows(M, N, 2 * K, [&](auto rb, int64_t n, int64_t m0) {
    w16_rows<kHalf, decltype(rb)::value>(wp + n * K, xp + m0 * K, K, K, op + m0 * N + n, N);
  });
  return out;
}

}  // namespace

at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "linear_w16: x [rows, in] float32 contiguous");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous() &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "linear_w16: w [out, in] bfloat16 or float16 contiguous, in = x's");
  at::Tensor out = w.scalar_type() == at::kHalf ? run<true>(x, w) : run<false>(x, w);
  gemv::add_bias(out, bias);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("linear_w16(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.impl("linear_w16", c10::DispatchKey::CPU, &linear_w16);
}

}  // namespace kvmesh
