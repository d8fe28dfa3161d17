// Float32 activations times 16-bit weights (bfloat16 or float16) for CPUs without native bf16 matmuls: the weights
// stay in memory at 2 bytes each and are widened to float32 in registers (a bf16 is the top half of a float32; an
// fp16 goes through F16C's vcvtph2ps), so a memory-bound decode step reads half the bytes of a float32 model.
// Twin: kernels/cpu/gemv_bf16.py's linear_w16_ref (F.linear on the weight converted to float32); the sums differ
// only in float32 summation order.
#include <torch/library.h>

#include <cmath>

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

// Small steps read one weight row at a time (gemv::over_blocks<1, ...>): one sequential stream, which the hardware
// prefetchers follow best (two or four rows' streams interleaved measured 0.4-0.8x at one row). From kMinRowsWide
// rows on (kMinRowsWideLongK for rows of at least kWideK values) the step is bound by the arithmetic, not the
// weight traffic, and takes kWideW weight rows by kWideRows activation rows at a time (gemv::over_blocks),
// prefetching each weight row kAhead values ahead: near the FMA units' peak, about twice gemv::tiled's float32
// tiles and MKL at 16-64 rows. Past kMaxRowsW16 rows (prefill chunks) the tiles stay: there the blocks measured
// only 1.02-1.1x faster on one CPU, their activations no longer fit the core's cache, and MKL is at its best.
constexpr int64_t kMinRowsWide = 9;
constexpr int64_t kMinRowsWideLongK = 5;
constexpr int64_t kWideK = 1024;
constexpr int kWideW = 3;
constexpr int kWideRows = 2;
constexpr int64_t kAhead = 512;
constexpr int64_t kMaxRowsW16 = 64;

// out[r * ldo + j] = dot(w[j * K : (j + 1) * K], x[r * ldx : r * ldx + K]) for j < NW weight rows, r < RB
// activation rows. Every output is summed the same way whatever block it is computed in (two vector accumulators,
// one for each half of a 2-vector step, added and summed across lanes, then the scalar tail), so a row's result
// does not depend on the rows beside it (the C++ stack and the eager model batch rows differently). The blocks
// give the core NW * RB * 2 independent chains, widen each weight vector once for RB rows and load each activation
// vector once for NW weight rows.
template <bool kHalf, int NW, int RB>
inline void w16_block(const uint16_t* w, const float* x, int64_t ldx, int64_t K, float* out, int64_t ldo) {
  float s[NW][RB];
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  {
    __m512 acc[2][NW][RB];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < NW; ++j)
        for (int r = 0; r < RB; ++r) acc[h][j][r] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      if constexpr (NW > 1) {
        for (int j = 0; j < NW; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kAhead), _MM_HINT_T0);
      }
      for (int h = 0; h < 2; ++h) {
        __m512 wv[NW];
        for (int j = 0; j < NW; ++j) wv[j] = w16_load16<kHalf>(w + j * K + k + 16 * h);
        for (int r = 0; r < RB; ++r) {
          const __m512 xv = _mm512_loadu_ps(x + r * ldx + k + 16 * h);
          for (int j = 0; j < NW; ++j) acc[h][j][r] = _mm512_fmadd_ps(wv[j], xv, acc[h][j][r]);
        }
      }
    }
    for (int j = 0; j < NW; ++j)
      for (int r = 0; r < RB; ++r) s[j][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][j][r], acc[1][j][r]));
  }
#elif defined(KVMESH_GEMV_AVX2)
  {
    __m256 acc[2][NW][RB];
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < NW; ++j)
        for (int r = 0; r < RB; ++r) acc[h][j][r] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      if constexpr (NW > 1) {
        if ((k & 31) == 0) {
          for (int j = 0; j < NW; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + j * K + k + kAhead), _MM_HINT_T0);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256 wv[NW];
        for (int j = 0; j < NW; ++j) wv[j] = w16_load8<kHalf>(w + j * K + k + 8 * h);
        for (int r = 0; r < RB; ++r) {
          const __m256 xv = _mm256_loadu_ps(x + r * ldx + k + 8 * h);
          for (int j = 0; j < NW; ++j) acc[h][j][r] = _mm256_fmadd_ps(wv[j], xv, acc[h][j][r]);
        }
      }
    }
    for (int j = 0; j < NW; ++j)
      for (int r = 0; r < RB; ++r) s[j][r] = gemv::hsum(_mm256_add_ps(acc[0][j][r], acc[1][j][r]));
  }
#else
  for (int j = 0; j < NW; ++j)
    for (int r = 0; r < RB; ++r) s[j][r] = 0.f;
#endif
  // The tail as explicit fused multiply-adds: left to the compiler, a*b+c is contracted or not depending on how it
  // vectorises each block shape, and the bits would depend on the block.
  for (; k < K; ++k) {
    for (int j = 0; j < NW; ++j) {
      const float wv = w16_scalar<kHalf>(w[j * K + k]);
      for (int r = 0; r < RB; ++r) s[j][r] = std::fma(wv, x[r * ldx + k], s[j][r]);
    }
  }
  for (int j = 0; j < NW; ++j)
    for (int r = 0; r < RB; ++r) out[r * ldo + j] = s[j][r];
}

template <bool kHalf>
at::Tensor run(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* wp = ptr<uint16_t>(w);
  const float* xp = x.data_ptr<float>();
  if (M > kMaxRowsW16) {
    return gemv::tiled(x, N, K, [&](int64_t n0, int64_t n1, float* dst) {
      for (int64_t i = 0; i < (n1 - n0) * K; ++i) dst[i] = w16_scalar<kHalf>(wp[n0 * K + i]);
    });
  }
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  auto block = [&](auto nw, auto rb, int64_t n0, int64_t m0) {
    w16_block<kHalf, decltype(nw)::value, decltype(rb)::value>(wp + n0 * K, xp + m0 * K, K, K, op + m0 * N + n0, N);
  };
  if (M < (K >= kWideK ? kMinRowsWideLongK : kMinRowsWide)) {
    gemv::over_blocks<1, gemv::kRowBlock>(M, N, 2 * K, block);
  } else {
    gemv::over_blocks<kWideW, kWideRows>(M, N, 2 * K, block);
  }
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
