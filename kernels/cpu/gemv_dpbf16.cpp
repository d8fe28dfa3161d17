// bfloat16 activations times a bfloat16 weight on CPUs with AVX512-BF16, on the kernels' own threads: vdpbf16ps
// multiplies 32 pairs of bf16 values and adds them into 16 float32 sums in one instruction, twice the arithmetic
// of widening to float32 and no conversion at all, so steps of a few rows run as fast as oneDNN's bf16 matmul
// while their loop can be shared out chunk by chunk (thread_pool.h) rather than in the fixed halves of an OpenMP
// team, which stall when another process takes a core. Output bf16: the float32 sum plus the bias, rounded to
// nearest even once.
// Twin: kernels/cpu/gemv_dpbf16.py's linear_dpbf16_ref (a float32 matmul of the bf16 values); the sums differ only
// in float32 summation order (and vdpbf16ps flushes denormal inputs and results to zero).
#include <torch/library.h>

#include "gemv.h"
#include "ops.h"

namespace kvmesh {
namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBuilt = true;
constexpr int64_t kOut = 32;  // outputs per weight block (two vectors of 16)
constexpr int kRows = 4;      // activation rows per pass over a block

// One block of kOut outputs for RB activation rows. The block's weights are one stream: for each pair of input
// columns kk, 64 bf16 values (output o's pair at 2 o, 2 o + 1), so vdpbf16ps adds w[o][2kk] x[2kk] +
// w[o][2kk + 1] x[2kk + 1] into lane o, with x's pair broadcast. Every output is summed the same way in any pass
// (its even and odd kk in two float32 chains, added at the end), so a row's result does not depend on the rows
// beside it; there are no sums across lanes.
template <int RB>
inline void dp_block(const uint16_t* w, int64_t K2, const uint32_t* x, int64_t ldx, const float* bias, int64_t n_out,
                     uint16_t* out, int64_t ldo) {
  __m512 acc[2][2][RB];  // [kk parity][vector][row]
  for (int h = 0; h < 2; ++h)
    for (int v = 0; v < 2; ++v)
      for (int r = 0; r < RB; ++r) acc[h][v][r] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 2 <= K2; kk += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (kk + 8) * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + (kk + 8) * 64 + 64), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const uint16_t* wk = w + (kk + h) * 64;
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
      for (int r = 0; r < RB; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(x[r * ldx + kk + h]));
        acc[h][0][r] = _mm512_dpbf16_ps(acc[h][0][r], w0, xb);
        acc[h][1][r] = _mm512_dpbf16_ps(acc[h][1][r], w1, xb);
      }
    }
  }
  if (kk < K2) {  // an odd number of pairs: the last is an even kk
    const uint16_t* wk = w + kk * 64;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
    for (int r = 0; r < RB; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(x[r * ldx + kk]));
      acc[0][0][r] = _mm512_dpbf16_ps(acc[0][0][r], w0, xb);
      acc[0][1][r] = _mm512_dpbf16_ps(acc[0][1][r], w1, xb);
    }
  }
  const __mmask16 m0 = n_out >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_out) - 1);
  const __mmask16 m1 = n_out >= 32 ? __mmask16(0xFFFF) : n_out <= 16 ? 0 : __mmask16((1u << (n_out - 16)) - 1);
  const __m512 b0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < RB; ++r) {
    const __m512 s0 = _mm512_add_ps(_mm512_add_ps(acc[0][0][r], acc[1][0][r]), b0);
    const __m512 s1 = _mm512_add_ps(_mm512_add_ps(acc[0][1][r], acc[1][1][r]), b1);
    _mm256_mask_storeu_epi16(out + r * ldo, m0, (__m256i)_mm512_cvtneps_pbh(s0));
    _mm256_mask_storeu_epi16(out + r * ldo + 16, m1, (__m256i)_mm512_cvtneps_pbh(s1));
  }
}

at::Tensor run(const at::Tensor& x, const at::Tensor& w, int64_t N, const float* bias) {
  const int64_t M = x.size(0), K2 = x.size(1) / 2, blocks = w.size(0);
  const uint16_t* wp = ptr<uint16_t>(w);
  const uint32_t* xp = ptr<uint32_t>(x);
  at::Tensor out = at::empty({M, N}, x.options());
  uint16_t* op = ptr<uint16_t>(out);
  const int64_t grain = std::max<int64_t>(1, (int64_t(32) << 10) / (kOut * 4 * K2));
  parallel_for(0, blocks, grain, [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g) {
      const int64_t n0 = g * kOut, n_out = std::min(kOut, N - n0);
      const uint16_t* wg = wp + g * K2 * 64;
      const float* bg = bias ? bias + n0 : nullptr;
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) dp_block<kRows>(wg, K2, xp + m * K2, K2, bg, n_out, op + m * N + n0, N);
      if (m < M) {
        gemv::with_constant<kRows>(int(M - m), [&](auto rb) {
          dp_block<decltype(rb)::value>(wg, K2, xp + m * K2, K2, bg, n_out, op + m * N + n0, N);
        });
      }
    }
  });
  return out;
}
#else
constexpr bool kBuilt = false;
constexpr int64_t kOut = 32;

at::Tensor run(const at::Tensor& x, const at::Tensor&, int64_t, const float*) {
  return x;
}
#endif

}  // namespace

at::Tensor linear_dpbf16(const at::Tensor& x, const at::Tensor& w, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(kBuilt, "linear_dpbf16: built without AVX512-BF16 (this CPU's flags); use the torch path");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % 2 == 0,
              "linear_dpbf16: x [rows, in] bfloat16 contiguous, in even");
  const int64_t K = x.size(1), N = out_features;
  TORCH_CHECK(w.dim() == 2 && w.size(0) == (N + kOut - 1) / kOut && w.size(1) == kOut * K &&
                  w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "linear_dpbf16: w [ceil(out / 32), 32 * in] bfloat16 contiguous (pack_dpbf16's layout)");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "linear_dpbf16: bias [out]");
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  return run(x, w, N, bias ? b.data_ptr<float>() : nullptr);
}

bool dpbf16_built() {
  return kBuilt;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("linear_dpbf16(Tensor x, Tensor w, int out_features, Tensor? bias) -> Tensor");
  m.impl("linear_dpbf16", c10::DispatchKey::CPU, &linear_dpbf16);
  m.def("dpbf16_built() -> bool", &dpbf16_built);
}

}  // namespace kvmesh
