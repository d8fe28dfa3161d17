// Float32 activations times weights kept in GGUF's blocks of 32 (dequantized in registers, never in memory):
//   fmt 0, Q4 (GGUF Q4_0 and Q4_1): qs uint8 [N, K / 2], block b of a row at bytes 16 b .. 16 b + 15, byte j holding
//     weight 32 b + j in its low nibble and 32 b + j + 16 in its high one (GGUF's own order); scales [N, K / 32, 2]
//     = (d, m): w = q d + m (Q4_0: m = -8 d), float32, or float16 where every scale is exact in it (Q4_0's and
//     Q4_1's are: the file stores them so), which a memory-bound step then reads 0.625 bytes a weight for, not 0.75.
//   fmt 1, Q8_0: qs int8 [N, K], scales float32 [N, K / 32] = d: w = q d.
//   fmt 2, Q8_16 (GGUF Q6_K: 6-bit codes minus 32, one scale per 16): qs int8 [N, K], scales float32 [N, K / 16]:
//     w = q d, d of the column's 16.
//   fmt 3 / 4, Q4 / Q8_0 with the rows interleaved in groups (kQ4X, kQ8X below), int8 activations only.
// Two ways to multiply, chosen per format by the caller (kernels/cpu/gemv_gguf.py, measured):
//   act 0: the weights widened to float32 and multiplied by the float32 activations (the sum of q x per block,
//     times d, plus m times the block's sum of x): the exact dequantized product up to float32 summation order.
//   act 1: the activation rows first quantized to blocks of 32 int8 (d_x = max |x| / 127, q_x = round(x / d_x),
//     llama.cpp's Q8_1 activations with a float32 scale), then integer dot products of the codes
//     (AVX2 vpmaddubsw + vpmaddwd, or AVX512-VNNI vpdpbusd): sum_b d d_x sum(q q_x) + m d_x sum(q_x).
//     It rounds the activations to 8 bits (relative error up to 1/254 of each block's largest value).
// Twin: kernels/cpu/gemv_gguf.py's linear_gguf_ref (dequantize by the format's definition, the activations
// through the same int8 rounding for act 1, then a float32 matmul).
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "gemv.h"
#include "ops.h"

namespace kvmesh {
namespace {

constexpr int64_t QK = 32;
enum Fmt : int64_t { kQ4 = 0, kQ8_0 = 1, kQ8_16 = 2, kQ4X = 3, kQ8X = 4 };

// kQ4X: Q4 blocks of kLanes weight rows interleaved (int8 activations only), so that each vector lane accumulates
// one output row: for group g (rows kLanes g ..) and block b, 4 chunks of kLanes x 4 bytes, chunk c holding bytes
// 4c .. 4c + 3 of each row's block (its codes 4c .. 4c + 3 in the low nibbles, 16 + 4c .. in the high ones); the
// scales as [groups, blocks, 2, kLanes] (each row's d, then each row's m). One vector load feeds kLanes rows, the
// activations' four codes are broadcast, and no sum ever crosses lanes: a batch-1 step's block kernel was bound
// by its horizontal sums and shuffles, not the weight traffic (llama.cpp's repacked Q4_0 does the same).
// kQ8X: Q8_0 blocks interleaved the same way: for group g and block b, 8 chunks of kLanes x 4 codes (chunk c:
// codes 4c .. 4c + 3 of each row's block); the scales as [groups, blocks, kLanes]. A batch-1 step through the
// one-row Q8_0 kernel read 20 GB/s where Q4's reached 50 (Qwen3-0.6B's 151,936-row head: 8-9 ms a token).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

// ---- act 0: float32 activations --------------------------------------------------------------------------------

// A Q4 scale as float32 (S: float, or at::Half for float16 scales: one F16C instruction where built with it;
// c10::Half's own conversion is a dozen integer operations, and the blocks past a row's last group of eight take
// two each).
inline float sf(float v) {
  return v;
}

inline float sf(at::Half v) {
#ifdef __F16C__
  return _cvtsh_ss(v.x);
#else
  return float(v);
#endif
}

template <int RB, typename S>
inline void q4_f32(const uint8_t* q, const S* sc, int64_t nb, const float* x, int64_t ldx, const float* xsum,
                   int64_t ldb, float* out, int64_t ldo) {
  float s[RB], ms[RB];
  for (int r = 0; r < RB; ++r) s[r] = ms[r] = 0.f;
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
    const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 d = _mm256_set1_ps(sf(sc[2 * b]));
    const float m = sf(sc[2 * b + 1]);
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * ldx + QK * b;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
      acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
      ms[r] += m * xsum[r * ldb + b];
    }
  }
  for (int r = 0; r < RB; ++r) s[r] = gemv::hsum(acc[r]);
#else
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * ldx + QK * b;
      float t = 0.f;
      for (int j = 0; j < 16; ++j) t += float(q[16 * b + j] & 15) * xr[j] + float(q[16 * b + j] >> 4) * xr[j + 16];
      s[r] += t * sf(sc[2 * b]);
      ms[r] += sf(sc[2 * b + 1]) * xsum[r * ldb + b];
    }
  }
#endif
  for (int r = 0; r < RB; ++r) out[r * ldo] = s[r] + ms[r];
}

// SUB16: a scale per 16 codes (Q8_16: sc[2 b] for the block's first half, sc[2 b + 1] for the second).
template <int RB, bool SUB16>
inline void q8_f32(const int8_t* q, const float* sc, int64_t nb, const float* x, int64_t ldx, float* out,
                   int64_t ldo) {
  float s[RB];
  for (int r = 0; r < RB; ++r) s[r] = 0.f;
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + QK * b));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + QK * b + 16));
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
    const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
    const __m256 d0 = _mm256_set1_ps(SUB16 ? sc[2 * b] : sc[b]), d1 = _mm256_set1_ps(SUB16 ? sc[2 * b + 1] : sc[b]);
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * ldx + QK * b;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
      if (SUB16) {
        acc[r] = _mm256_fmadd_ps(t, d0, acc[r]);
        t = _mm256_mul_ps(w2, _mm256_loadu_ps(xr + 16));
      } else {
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
      }
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
      acc[r] = _mm256_fmadd_ps(t, d1, acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) s[r] = gemv::hsum(acc[r]);
#else
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < RB; ++r) {
      const float* xr = x + r * ldx + QK * b;
      if (SUB16) {
        float t0 = 0.f, t1 = 0.f;
        for (int j = 0; j < 16; ++j) t0 += float(q[QK * b + j]) * xr[j];
        for (int j = 16; j < QK; ++j) t1 += float(q[QK * b + j]) * xr[j];
        s[r] += t0 * sc[2 * b] + t1 * sc[2 * b + 1];
        continue;
      }
      float t = 0.f;
      for (int j = 0; j < QK; ++j) t += float(q[QK * b + j]) * xr[j];
      s[r] += t * sc[b];
    }
  }
#endif
  for (int r = 0; r < RB; ++r) out[r * ldo] = s[r];
}

// ---- act 1: int8 activations -----------------------------------------------------------------------------------

// With int8 activations, steps of up to this many rows stay on the block kernels (more than gemv.h's kMaxRows):
// measured on 2 threads at 1024 x 6144 Q4 (AVX2, and AVX-512 with VNNI), they match or beat dequantized float32
// tiles through at::mm up to here (at 32 rows about even on AVX2; past 48 the tiles win).
constexpr int64_t kMaxRowsQ8 = 32;

#ifdef KVMESH_GEMV_AVX2
// Sum of u[i] * s[i] (u unsigned, s signed bytes) in 8 int32 lanes.
inline __m256i dot_us8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Blocks are taken eight at a time: each block's integer dot product is reduced to one lane and the eight are
// scaled by one vector of the blocks' d x d_x products, instead of a conversion, a scalar product, a broadcast and
// a multiply-add per block and row. Measured single-threaded (AVX2, 16 rows of 1024 x 6144 Q4): 1.45x faster than
// one block at a time. Q4 goes further (dot_pair, pair_sums): two blocks per weight load and three horizontal adds
// a group instead of seven.
constexpr int64_t kBlocks = 8;

// The horizontal sums of v[0..7] (8 int32 lanes each) as one vector: lane j is the sum of v[j].
inline __m256i hsum8_epi32(const __m256i* v) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}

inline __m256 load8(const at::Half* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm256_setr_ps(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
#endif
}

// Eight Q4 blocks' scales (d0, m0, d1, m1, ...) split into their d and their m, in the order pair_sums leaves the
// blocks' dot products in: 0 2 4 6 1 3 5 7.
template <typename S>
inline void split_dm(const S* sc, __m256& d, __m256& m) {
  const __m256 a = load8(sc), b = load8(sc + 8);
  // shuffle_ps leaves d0 d1 d4 d5 | d2 d3 d6 d7 (and the m likewise)
  const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
  d = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, 0x88), order);
  m = _mm256_permutevar8x32_ps(_mm256_shuffle_ps(a, b, 0xDD), order);
}

// A Q4 block's 32 codes (16 bytes: low nibbles are codes 0-15, high nibbles 16-31) as 32 bytes.
inline __m256i unpack_q4(const uint8_t* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Two Q4 blocks' dot products with their activation codes, from one 32-byte load of the weights: lo holds both
// blocks' low nibbles (codes 0-15 of the first block, then of the second), hi their high ones (codes 16-31), and
// xl / xh the activation codes in the same order (quantize_rows' paired layout). Lanes 0-3 hold partial sums of
// the first block, 4-7 of the second. Without VNNI the two byte products are added as int16 first: each is at
// most 2 * 15 * 127, so their sum cannot saturate.
inline __m256i dot_pair(__m256i lo, __m256i xl, __m256i hi, __m256i xh) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh);
#else
  return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)),
                           _mm256_set1_epi16(1));
#endif
}

// Four dot_pair results (blocks 0-1, 2-3, 4-5, 6-7 of a group) reduced to one lane per block, in the order
// 0 2 4 6 1 3 5 7: three horizontal adds where eight separate blocks take seven and two permutes.
inline __m256i pair_sums(const __m256i* p) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
}

// A group of eight Q4 blocks (four 32-byte loads of two blocks each) as the low and high nibbles dot_pair takes.
inline void unpack_group(const uint8_t* q, __m256i* lo, __m256i* hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < kBlocks / 2; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2 * 16 * j));
    lo[j] = _mm256_and_si256(raw, m4);
    hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
}

// An unpacked group's eight integer dot products with one activation row's codes there (the paired layout), as
// float32 in pair_sums' order.
inline __m256 group_dots(const __m256i* lo, const __m256i* hi, const int8_t* x) {
  __m256i p[kBlocks / 2];
  for (int j = 0; j < kBlocks / 2; ++j)
    p[j] = dot_pair(lo[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * QK * j)), hi[j],
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * QK * j + QK)));
  return _mm256_cvtepi32_ps(pair_sums(p));
}

// Eight Q8_0 blocks as the operands dot_us8 takes: |q| (unsigned) in aw, q itself (whose signs go to the
// activations) in qw.
inline void load_q8_group(const int8_t* q, __m256i* qw, __m256i* aw) {
  for (int j = 0; j < kBlocks; ++j) {
    qw[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + QK * j));
    aw[j] = _mm256_sign_epi8(qw[j], qw[j]);
  }
}

// A loaded Q8_0 group's eight integer dot products with one activation row's codes there, as float32 in block
// order.
inline __m256 q8_group_dots(const __m256i* qw, const __m256i* aw, const int8_t* x) {
  __m256i p[kBlocks];
  for (int j = 0; j < kBlocks; ++j) {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + QK * j));
    p[j] = dot_us8(aw[j], _mm256_sign_epi8(qx, qw[j]));
  }
  return _mm256_cvtepi32_ps(hsum8_epi32(p));
}
#endif

template <int RB, typename S>
inline void q4_q8(const uint8_t* q, const S* sc, int64_t nb, const int8_t* xq, int64_t ldq, const float* xd,
                  const float* xs, int64_t ldb, float* out, int64_t ldo) {
  float s[RB], ms[RB];
  for (int r = 0; r < RB; ++r) s[r] = ms[r] = 0.f;
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + kBlocks <= nb; b += kBlocks) {
    __m256i lo[kBlocks / 2], hi[kBlocks / 2];
    unpack_group(q + 16 * b, lo, hi);
    __m256 d, m;
    split_dm(sc + 2 * b, d, m);
    for (int r = 0; r < RB; ++r) {
      const __m256 dots = group_dots(lo, hi, xq + r * ldq + QK * b);
      acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * ldb + b)), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + r * ldb + b), acc[r]);
    }
  }
  // The last nb % 8 blocks one at a time. Explicit fused multiply-adds only: the compiler may contract a scalar
  // `s += a * b` in one row-block instantiation and not in another, and a row's result must not depend on how
  // many rows share its step.
  for (; b < nb; ++b) {
    const __m256i qw = unpack_q4(q + 16 * b);
    const float d = sf(sc[2 * b]), m = sf(sc[2 * b + 1]);
    for (int r = 0; r < RB; ++r) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * ldq + QK * b));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us8(qw, qx)), _mm256_set1_ps(d * xd[r * ldb + b]), acc[r]);
      ms[r] = std::fma(m, xs[r * ldb + b], ms[r]);
    }
  }
  for (int r = 0; r < RB; ++r) s[r] = gemv::hsum(acc[r]);
#else
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < RB; ++r) {
      const int8_t* xr = xq + r * ldq + QK * b;
      int32_t t = 0;
      for (int j = 0; j < 16; ++j) t += int32_t(q[16 * b + j] & 15) * xr[j] + int32_t(q[16 * b + j] >> 4) * xr[j + 16];
      s[r] += float(t) * (sf(sc[2 * b]) * xd[r * ldb + b]);
      ms[r] += sf(sc[2 * b + 1]) * xs[r * ldb + b];
    }
  }
#endif
  for (int r = 0; r < RB; ++r) out[r * ldo] = s[r] + ms[r];
}

// One activation row (a batch-1 decode step) against NW weight rows, outputs n .. n + NW - 1: each output's
// operations are q4_q8<1>'s in the same order (so its bits are too), interleaved across the NW rows, whose
// independent chains then overlap (measured, AVX2, one thread, SmolLM2 and Qwen3-0.6B shapes: 1.1-1.45x faster
// than one row at a time; four rows were no faster than two, and two activation rows or more are faster through
// q4_q8's hoisted weights). The weights are unpacked where they are used:
// hoisting them as q4_q8 does for several activation rows needs more registers than AVX2 has.
template <int NW, typename S>
inline void q4_q8_rows(const uint8_t* q, int64_t row_bytes, const S* sc, int64_t sc_per_row, int64_t nb,
                       const int8_t* xq, const float* xd, const float* xs, float* out) {
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[NW];
  float ms[NW];
  for (int w = 0; w < NW; ++w) {
    acc[w] = _mm256_setzero_ps();
    ms[w] = 0.f;
  }
  int64_t b = 0;
  for (; b + kBlocks <= nb; b += kBlocks) {
    const __m256 xdv = _mm256_loadu_ps(xd + b), xsv = _mm256_loadu_ps(xs + b);
    for (int w = 0; w < NW; ++w) {
      __m256i lo[kBlocks / 2], hi[kBlocks / 2];
      unpack_group(q + w * row_bytes + 16 * b, lo, hi);
      __m256 d, m;
      split_dm(sc + w * sc_per_row + 2 * b, d, m);
      const __m256 dots = group_dots(lo, hi, xq + QK * b);
      acc[w] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, xdv), acc[w]);
      acc[w] = _mm256_fmadd_ps(m, xsv, acc[w]);
    }
  }
  for (; b < nb; ++b) {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QK * b));
    for (int w = 0; w < NW; ++w) {
      const __m256i qw = unpack_q4(q + w * row_bytes + 16 * b);
      const float d = sf(sc[w * sc_per_row + 2 * b]), m = sf(sc[w * sc_per_row + 2 * b + 1]);
      acc[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us8(qw, qx)), _mm256_set1_ps(d * xd[b]), acc[w]);
      ms[w] = std::fma(m, xs[b], ms[w]);
    }
  }
  for (int w = 0; w < NW; ++w) out[w] = gemv::hsum(acc[w]) + ms[w];
#else
  for (int w = 0; w < NW; ++w) q4_q8<1>(q + w * row_bytes, sc + w * sc_per_row, nb, xq, 0, xd, xs, 0, out + w, 1);
#endif
}

template <int RB, bool SUB16>
inline void q8_q8(const int8_t* q, const float* sc, int64_t nb, const int8_t* xq, int64_t ldq, const float* xd,
                  int64_t ldb, float* out, int64_t ldo) {
  float s[RB];
  for (int r = 0; r < RB; ++r) s[r] = 0.f;
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b0 = 0;
  if (!SUB16) {  // Q8_0: one scale per block, eight blocks at a time (Q8_16's two scales a block stay below)
    for (; b0 + kBlocks <= nb; b0 += kBlocks) {
      __m256i qw[kBlocks], aw[kBlocks];
      load_q8_group(q + QK * b0, qw, aw);
      const __m256 d = _mm256_loadu_ps(sc + b0);
      for (int r = 0; r < RB; ++r) {
        const __m256 dots = q8_group_dots(qw, aw, xq + r * ldq + QK * b0);
        acc[r] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_loadu_ps(xd + r * ldb + b0)), acc[r]);
      }
    }
  }
  for (int64_t b = b0; b < nb; ++b) {
    const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + QK * b));
    const __m256i aw = _mm256_sign_epi8(qw, qw);  // |q|: the unsigned operand; the sign moves to the activations
    // Lane i of the dot product sums codes 4 i .. 4 i + 3: lanes 0-3 are the block's first 16, 4-7 the rest.
    const __m256 d = SUB16 ? _mm256_set_m128(_mm_set1_ps(sc[2 * b + 1]), _mm_set1_ps(sc[2 * b])) : _mm256_set1_ps(sc[b]);
    for (int r = 0; r < RB; ++r) {
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * ldq + QK * b));
      const __m256 p = _mm256_cvtepi32_ps(dot_us8(aw, _mm256_sign_epi8(qx, qw)));
      acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(xd[r * ldb + b])), acc[r]);
    }
  }
  for (int r = 0; r < RB; ++r) s[r] = gemv::hsum(acc[r]);
#else
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < RB; ++r) {
      const int8_t* xr = xq + r * ldq + QK * b;
      if (SUB16) {
        int32_t t0 = 0, t1 = 0;
        for (int j = 0; j < 16; ++j) t0 += int32_t(q[QK * b + j]) * xr[j];
        for (int j = 16; j < QK; ++j) t1 += int32_t(q[QK * b + j]) * xr[j];
        s[r] += (float(t0) * sc[2 * b] + float(t1) * sc[2 * b + 1]) * xd[r * ldb + b];
        continue;
      }
      int32_t t = 0;
      for (int j = 0; j < QK; ++j) t += int32_t(q[QK * b + j]) * xr[j];
      s[r] += float(t) * (sc[b] * xd[r * ldb + b]);
    }
  }
#endif
  for (int r = 0; r < RB; ++r) out[r * ldo] = s[r];
}

// One activation row against NW Q8_0 weight rows, interleaved as q4_q8_rows (each output's operations are
// q8_q8<1, false>'s in the same order). Measured as above: 1.25x at K = 576 (SmolLM2's head), even at K >= 1024.
template <int NW>
inline void q8_q8_rows(const int8_t* q, int64_t row_bytes, const float* sc, int64_t sc_per_row, int64_t nb,
                       const int8_t* xq, const float* xd, float* out) {
#ifdef KVMESH_GEMV_AVX2
  __m256 acc[NW];
  for (int w = 0; w < NW; ++w) acc[w] = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + kBlocks <= nb; b0 += kBlocks) {
    const __m256 xdv = _mm256_loadu_ps(xd + b0);
    for (int w = 0; w < NW; ++w) {
      __m256i qw[kBlocks], aw[kBlocks];
      load_q8_group(q + w * row_bytes + QK * b0, qw, aw);
      const __m256 dots = q8_group_dots(qw, aw, xq + QK * b0);
      acc[w] = _mm256_fmadd_ps(dots, _mm256_mul_ps(_mm256_loadu_ps(sc + w * sc_per_row + b0), xdv), acc[w]);
    }
  }
  for (int64_t b = b0; b < nb; ++b) {
    const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + QK * b));
    for (int w = 0; w < NW; ++w) {
      const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + w * row_bytes + QK * b));
      const __m256 p = _mm256_cvtepi32_ps(dot_us8(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qx, qw)));
      acc[w] = _mm256_fmadd_ps(p, _mm256_mul_ps(_mm256_set1_ps(sc[w * sc_per_row + b]), _mm256_set1_ps(xd[b])), acc[w]);
    }
  }
  for (int w = 0; w < NW; ++w) out[w] = gemv::hsum(acc[w]);
#else
  for (int w = 0; w < NW; ++w) q8_q8<1, false>(q + w * row_bytes, sc + w * sc_per_row, nb, xq, 0, xd, 0, out + w, 1);
#endif
}

// ---- kQ4X: interleaved Q4 rows, int8 activations -----------------------------------------------------------

// The interleaved kernels' common steps: a block's integer sums into the lanes' float32 sums (acc + isum d d_x),
// and a group's n_out real outputs stored.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline __m512 add_block(__m512 acc, __m512i isum, __m512 d, float dx) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
}

inline void store_lanes(float* out, __m512 acc, int64_t n_out) {
  _mm512_mask_storeu_ps(out, n_out >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n_out) - 1), acc);
}

inline void store_lanes(uint16_t* out, __m512 acc, int64_t n_out) {  // bf16 outputs, rounded to nearest even
  alignas(64) float v[16];
  _mm512_store_ps(v, acc);
  for (int64_t i = 0; i < n_out; ++i) out[i] = float_to_bf16(v[i]);
}
#elif defined(KVMESH_GEMV_AVX2)
inline __m256 add_block(__m256 acc, __m256i isum, __m256 d, float dx) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
}

template <typename O>
inline void store_lanes(O* out, __m256 acc, int64_t n_out) {
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  for (int64_t i = 0; i < n_out; ++i) Act<O>::store(out + i, v[i]);
}
#endif

// Outputs of one group of kLanes weight rows (n_out of them real) for RB activation rows: out[r * ldo + i] =
// sum_b (d_i d_x isum + m_i s_x), block by block in order, in float32, the same operations for every row (a
// row's bits do not depend on its batch).
template <int RB, typename S, typename O>
inline void q4x_group(const uint8_t* q, const S* sc, int64_t nb, const int8_t* xq, int64_t ldq, const float* xd,
                      const float* xs, int64_t ldb, O* out, int64_t ldo, int64_t n_out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * 16 * kLanes;
    __m512i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(qb + c * 4 * kLanes);
      const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = xq + r * ldq + QK * b + 4 * c;
        int32_t xl, xh;
        std::memcpy(&xl, x, 4);
        std::memcpy(&xh, x + 16, 4);
        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(xl));
        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(xh));
      }
    }
    __m512 d, m;
    if constexpr (std::is_same_v<S, float>) {
      d = _mm512_loadu_ps(sc + b * 2 * kLanes);
      m = _mm512_loadu_ps(sc + b * 2 * kLanes + kLanes);
    } else {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * 2 * kLanes)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * 2 * kLanes + kLanes)));
    }
    for (int r = 0; r < RB; ++r)
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * ldb + b]), add_block(acc[r], isum[r], d, xd[r * ldb + b]));
  }
  for (int r = 0; r < RB; ++r) store_lanes(out + r * ldo, acc[r], n_out);
#elif defined(KVMESH_GEMV_AVX2)
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * 16 * kLanes;
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 4 * kLanes));
      const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      for (int r = 0; r < RB; ++r) {
        const int8_t* x = xq + r * ldq + QK * b + 4 * c;
        int32_t xl, xh;
        std::memcpy(&xl, x, 4);
        std::memcpy(&xh, x + 16, 4);
        // each int16 of maddubs is at most 2 * 15 * 127: the two products add without saturating
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh))), _mm256_set1_epi16(1)));
      }
    }
    const __m256 d = load8(sc + b * 2 * kLanes), m = load8(sc + b * 2 * kLanes + kLanes);
    for (int r = 0; r < RB; ++r)
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * ldb + b]), add_block(acc[r], isum[r], d, xd[r * ldb + b]));
  }
  for (int r = 0; r < RB; ++r) store_lanes(out + r * ldo, acc[r], n_out);
#else
  for (int r = 0; r < RB; ++r) {
    for (int64_t i = 0; i < n_out; ++i) {
      float a = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qb = q + b * 16 * kLanes;
        int32_t isum = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = qb[(j / 4) * 4 * kLanes + 4 * i + j % 4];
          isum += int32_t(byte & 15) * xq[r * ldq + QK * b + j] + int32_t(byte >> 4) * xq[r * ldq + QK * b + 16 + j];
        }
        const float d = sf(sc[b * 2 * kLanes + i]), m = sf(sc[b * 2 * kLanes + kLanes + i]);
        a = std::fma(float(isum), d * xd[r * ldb + b], a);
        a = std::fma(m, xs[r * ldb + b], a);
      }
      Act<O>::store(out + r * ldo + i, a);
    }
  }
#endif
}

// Outputs of one group of kLanes Q8_0 rows for RB activation rows, as q4x_group: out = sum_b d_i d_x isum. The
// byte products need an unsigned operand: |w| times the activation codes with w's signs.
template <int RB, typename O>
inline void q8x_group(const int8_t* q, const float* sc, int64_t nb, const int8_t* xq, int64_t ldq, const float* xd,
                      int64_t ldb, O* out, int64_t ldo, int64_t n_out) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = q + b * QK * kLanes;
    __m512i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(qb + c * 4 * kLanes);
      const __m512i aw = _mm512_abs_epi8(w);
      const __mmask64 neg = _mm512_movepi8_mask(w);
      for (int r = 0; r < RB; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * ldq + QK * b + 4 * c, 4);
        const __m512i xb = _mm512_set1_epi32(x4);
        isum[r] = _mm512_dpbusd_epi32(isum[r], aw, _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb));
      }
    }
    const __m512 d = _mm512_loadu_ps(sc + b * kLanes);
    for (int r = 0; r < RB; ++r) acc[r] = add_block(acc[r], isum[r], d, xd[r * ldb + b]);
  }
  for (int r = 0; r < RB; ++r) store_lanes(out + r * ldo, acc[r], n_out);
#elif defined(KVMESH_GEMV_AVX2)
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* qb = q + b * QK * kLanes;
    __m256i isum[RB];
    for (int r = 0; r < RB; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + c * 4 * kLanes));
      const __m256i aw = _mm256_abs_epi8(w);
      for (int r = 0; r < RB; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * ldq + QK * b + 4 * c, 4);
        // |w| <= 127: each int16 of maddubs is at most 2 * 127 * 127, no saturation
        isum[r] = _mm256_add_epi32(
            isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_set1_epi32(x4), w)), ones));
      }
    }
    const __m256 d = _mm256_loadu_ps(sc + b * kLanes);
    for (int r = 0; r < RB; ++r) acc[r] = add_block(acc[r], isum[r], d, xd[r * ldb + b]);
  }
  for (int r = 0; r < RB; ++r) store_lanes(out + r * ldo, acc[r], n_out);
#else
  for (int r = 0; r < RB; ++r) {
    for (int64_t i = 0; i < n_out; ++i) {
      float a = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* qb = q + b * QK * kLanes;
        int32_t isum = 0;
        for (int j = 0; j < QK; ++j) isum += int32_t(qb[(j / 4) * 4 * kLanes + 4 * i + j % 4]) * xq[r * ldq + QK * b + j];
        a = std::fma(float(isum), sc[b * kLanes + i] * xd[r * ldb + b], a);
      }
      Act<O>::store(out + r * ldo + i, a);
    }
  }
#endif
}

// Where quantize_rows puts each activation row's codes and block scales for the Q4 kernel (paired) or the Q8 ones.
// Paired (AVX2 builds; the scalar kernels read the plain layout): within each whole group of eight blocks, the
// codes of blocks 2j and 2j + 1 as 64 bytes, codes 0-15 of the first, 0-15 of the second, 16-31 of the first,
// 16-31 of the second (what dot_pair multiplies one 32-byte load of the two weight blocks' nibbles by), and the
// group's d / s in pair_sums' order 0 2 4 6 1 3 5 7; the blocks after the last whole group plainly.
#ifdef KVMESH_GEMV_AVX2
constexpr bool kPairedQ4 = true;
#else
constexpr bool kPairedQ4 = false;
#endif

// Each activation row in blocks of 32: d = max |x| / 127, q = round-half-even(x * 127 / max |x|), s = d * sum(q).
// T: float, or uint16_t (bf16 activations, read as the float32 values they are).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs, bool paired) {
  const int64_t nb = K / QK, grouped = paired ? nb / 8 * 8 : 0;
  for (int64_t i = 0; i < M * nb; ++i) {
    const int64_t row = i / nb, b = i % nb;
    float v[QK];
    for (int j = 0; j < QK; ++j) v[j] = Act<T>::load(x + i * QK + j);
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    // where block b's codes 0-15 and 16-31 go, and its slot among the row's scales
    int8_t *first = xq + i * QK, *second = first + 16;
    int64_t slot = b;
    if (b < grouped) {
      const int64_t g = b / 8 * 8, j = b % 8;
      first = xq + row * K + QK * g + 2 * QK * (j / 2) + 16 * (j % 2);
      second = first + QK;
      slot = g + (j % 2) * 4 + j / 2;
    }
    int32_t sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int32_t c = int32_t(std::nearbyint(v[j] * id));
      (j < 16 ? first : second)[j % 16] = int8_t(c);
      sum += c;
    }
    xd[row * nb + slot] = d;
    xs[row * nb + slot] = d * float(sum);
  }
}

// Rows [n0, n1) of the weight as float32 (the tiles of steps past the block kernels' rows). S: the scales' type
// (float16 for Q4 only).
template <typename S>
void dequant_rows(int64_t fmt, const uint8_t* qs, const S* sc, int64_t K, int64_t n0, int64_t n1, float* dst) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    float* o = dst + (n - n0) * K;
    for (int64_t b = 0; b < nb; ++b) {
      if (fmt == kQ4X) {
        const int64_t g = n / kLanes, i = n % kLanes;
        const uint8_t* qb = qs + g * kLanes * (K / 2) + b * 16 * kLanes;
        const S* sg = sc + (g * nb + b) * 2 * kLanes;
        const float d = sf(sg[i]), m = sf(sg[kLanes + i]);
        int32_t row[4];  // this row's 16 bytes of the block, gathered from the four chunks
        for (int c = 0; c < 4; ++c) std::memcpy(row + c, qb + c * 4 * kLanes + 4 * i, 4);
#ifdef KVMESH_GEMV_AVX2
        // inserted lane by lane: a 16-byte load of the four 4-byte stores above would stall on store forwarding
        const __m128i raw = _mm_setr_epi32(row[0], row[1], row[2], row[3]), m4 = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; ++p) {
          const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
          _mm256_storeu_ps(o + QK * b + 8 * p, _mm256_fmadd_ps(w, dv, mv));
        }
#else
        const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
        for (int j = 0; j < 16; ++j) {
          o[QK * b + j] = float(bytes[j] & 15) * d + m;
          o[QK * b + j + 16] = float(bytes[j] >> 4) * d + m;
        }
#endif
      } else if (fmt == kQ8X) {
        const int64_t g = n / kLanes, i = n % kLanes;
        const int8_t* qb = reinterpret_cast<const int8_t*>(qs) + g * kLanes * K + b * QK * kLanes;
        const float d = sf(sc[(g * nb + b) * kLanes + i]);
        for (int c = 0; c < 8; ++c)
          for (int t = 0; t < 4; ++t) o[QK * b + 4 * c + t] = float(qb[c * 4 * kLanes + 4 * i + t]) * d;
      } else if (fmt == kQ4) {
        const uint8_t* q = qs + n * (K / 2) + 16 * b;
        const float d = sf(sc[2 * (n * nb + b)]), m = sf(sc[2 * (n * nb + b) + 1]);
        for (int j = 0; j < 16; ++j) {
          o[QK * b + j] = float(q[j] & 15) * d + m;
          o[QK * b + j + 16] = float(q[j] >> 4) * d + m;
        }
      } else if (fmt == kQ8_0) {
        const int8_t* q = reinterpret_cast<const int8_t*>(qs) + n * K + QK * b;
        const float d = sf(sc[n * nb + b]);
        for (int j = 0; j < QK; ++j) o[QK * b + j] = float(q[j]) * d;
      } else {
        const int8_t* q = reinterpret_cast<const int8_t*>(qs) + n * K + QK * b;
        const S* d = sc + 2 * (n * nb + b);
        for (int j = 0; j < QK; ++j) o[QK * b + j] = float(q[j]) * sf(d[j / 16]);
      }
    }
  }
}

// The interleaved formats' product (kQ4X, kQ8X): int8 activations up to kMaxRowsQ8 rows (groups of kLanes outputs
// in parallel, passes of up to four activation rows), dequantized float32 tiles above.
template <typename S, typename T>
at::Tensor product_x(const at::Tensor& x, const uint8_t* qp, const S* sp, int64_t N, int64_t fmt) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  if (M > kMaxRowsQ8) {
    const at::Tensor xf = x.to(at::kFloat);
    at::Tensor out = gemv::tiled(xf, N, K, [&](int64_t n0, int64_t n1, float* dst) {
      dequant_rows(fmt, qp, sp, K, n0, n1, dst);
    });
    return out.to(x.scalar_type());
  }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  quantize_rows(ptr<T>(x), M, K, xq.data(), xd.data(), xs.data(), false);
  at::Tensor out = at::empty({M, N}, x.options());
  T* op = ptr<T>(out);
  const bool q4 = fmt == kQ4X;
  const int64_t groups = (N + kLanes - 1) / kLanes, group_bytes = kLanes * (q4 ? K / 2 : K);
  const int64_t group_scales = nb * (q4 ? 2 : 1) * kLanes;
  const int64_t grain = std::max<int64_t>(1, (int64_t(32) << 10) / group_bytes);
  parallel_for(0, groups, grain, [&](int64_t a, int64_t e) {
    for (int64_t g = a; g < e; ++g) {
      const uint8_t* q = qp + g * group_bytes;
      const S* sc = sp + g * group_scales;
      const int64_t n0 = g * kLanes, n_out = std::min(kLanes, N - n0);
      auto pass = [&](auto rb, int64_t m) {
        constexpr int RB = decltype(rb)::value;
        if (q4) {
          q4x_group<RB>(q, sc, nb, xq.data() + m * K, K, xd.data() + m * nb, xs.data() + m * nb, nb, op + m * N + n0,
                        N, n_out);
        } else if constexpr (std::is_same_v<S, float>) {
          q8x_group<RB>(reinterpret_cast<const int8_t*>(q), sc, nb, xq.data() + m * K, K, xd.data() + m * nb, nb,
                        op + m * N + n0, N, n_out);
        }
      };
      int64_t m = 0;
      for (; m + gemv::kRowBlock <= M; m += gemv::kRowBlock) pass(std::integral_constant<int, gemv::kRowBlock>(), m);
      if (m < M) gemv::with_constant<gemv::kRowBlock>(int(M - m), [&](auto rb) { pass(rb, m); });
    }
  });
  return out;
}

// The product for scales of type S: float, or at::Half (Q4 only: the Q8 branches exist for float scales alone).
template <typename S>
at::Tensor product(const at::Tensor& x, const uint8_t* qp, const S* sp, int64_t N, int64_t fmt, int64_t act) {
  constexpr bool kFloatScales = std::is_same_v<S, float>;
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const int64_t sc_per_row = fmt == kQ8_0 ? nb : 2 * nb;  // Q4: (d, m) per 32; Q8_16: d per 16
  const int64_t row_bytes = fmt == kQ4 ? K / 2 : K;
  const float* xp = x.data_ptr<float>();
  const int8_t* q8 = reinterpret_cast<const int8_t*>(qp);
  if (M > (act == 1 ? kMaxRowsQ8 : gemv::kMaxRows))
    return gemv::tiled(x, N, K, [&](int64_t n0, int64_t n1, float* dst) { dequant_rows(fmt, qp, sp, K, n0, n1, dst); });
  at::Tensor out = at::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  if (act == 0) {
    std::vector<float> xsum(fmt == kQ4 ? M * nb : 0);
    for (int64_t i = 0; i < int64_t(xsum.size()); ++i) {
      float t = 0.f;
      for (int j = 0; j < QK; ++j) t += xp[i * QK + j];
      xsum[i] = t;
    }
    gemv::over_rows(M, N, row_bytes, [&](auto rb, int64_t n, int64_t m0) {
      constexpr int RB = decltype(rb)::value;
      if (fmt == kQ4) {
        q4_f32<RB>(qp + n * row_bytes, sp + n * sc_per_row, nb, xp + m0 * K, K, xsum.data() + m0 * nb, nb,
                   op + m0 * N + n, N);
      } else if constexpr (kFloatScales) {
        if (fmt == kQ8_0) {
          q8_f32<RB, false>(q8 + n * row_bytes, sp + n * sc_per_row, nb, xp + m0 * K, K, op + m0 * N + n, N);
        } else {
          q8_f32<RB, true>(q8 + n * row_bytes, sp + n * sc_per_row, nb, xp + m0 * K, K, op + m0 * N + n, N);
        }
      }
    });
    return out;
  }
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  quantize_rows(xp, M, K, xq.data(), xd.data(), xs.data(), fmt == kQ4 && kPairedQ4);
  if (M == 1 && fmt != kQ8_16) {
    gemv::over_row_pairs(N, row_bytes, [&](auto nw, int64_t n) {
      constexpr int NW = decltype(nw)::value;
      if (fmt == kQ4) {
        q4_q8_rows<NW>(qp + n * row_bytes, row_bytes, sp + n * sc_per_row, sc_per_row, nb, xq.data(), xd.data(),
                       xs.data(), op + n);
      } else if constexpr (kFloatScales) {
        q8_q8_rows<NW>(q8 + n * row_bytes, row_bytes, sp + n * sc_per_row, sc_per_row, nb, xq.data(), xd.data(),
                       op + n);
      }
    });
    return out;
  }
  gemv::over_rows(M, N, row_bytes, [&](auto rb, int64_t n, int64_t m0) {
    constexpr int RB = decltype(rb)::value;
    if (fmt == kQ4) {
      q4_q8<RB>(qp + n * row_bytes, sp + n * sc_per_row, nb, xq.data() + m0 * K, K, xd.data() + m0 * nb,
                xs.data() + m0 * nb, nb, op + m0 * N + n, N);
    } else if constexpr (kFloatScales) {
      if (fmt == kQ8_0) {
        q8_q8<RB, false>(q8 + n * row_bytes, sp + n * sc_per_row, nb, xq.data() + m0 * K, K, xd.data() + m0 * nb, nb,
                         op + m0 * N + n, N);
      } else {
        q8_q8<RB, true>(q8 + n * row_bytes, sp + n * sc_per_row, nb, xq.data() + m0 * K, K, xd.data() + m0 * nb, nb,
                        op + m0 * N + n, N);
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t fmt, int64_t act) {
  TORCH_CHECK(fmt >= kQ4 && fmt <= kQ8X,
              "linear_gguf: fmt 0 (Q4_0/Q4_1/Q4_K), 1 (Q8_0), 2 (Q8_16: Q6_K), 3 / 4 (Q4 / Q8_0 rows interleaved), got ",
              fmt);
  const bool interleaved = fmt == kQ4X || fmt == kQ8X;
  TORCH_CHECK(!interleaved || act == 1, "linear_gguf: interleaved rows take int8 activations (act 1)");
  TORCH_CHECK(act == 0 || act == 1, "linear_gguf: act 0 (float32) or 1 (int8), got ", act);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.is_contiguous(),
              "linear_gguf: x [rows, in] float32 or bfloat16 contiguous");
  const int64_t K = x.size(1), N = qs.size(0), nb = K / QK;
  TORCH_CHECK(K % QK == 0, "linear_gguf: in features ", K, " not a multiple of 32");
  const bool q4 = fmt == kQ4 || fmt == kQ4X;
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (q4 ? K / 2 : K) &&
                  qs.scalar_type() == (q4 ? at::kByte : at::kChar),
              "linear_gguf: qs [out, in / 2] uint8 (Q4) or [out, in] int8 (Q8_0, Q8_16), contiguous");
  TORCH_CHECK(!interleaved || N % kLanes == 0, "linear_gguf: interleaved rows come in groups of ", kLanes);
  const int64_t sc_per_row = fmt == kQ8_0 || fmt == kQ8X ? nb : 2 * nb;
  const bool half = q4 && scales.scalar_type() == at::kHalf;
  TORCH_CHECK((scales.scalar_type() == at::kFloat || half) && scales.is_contiguous() &&
                  scales.numel() == N * sc_per_row,
              "linear_gguf: scales float32 (Q4: or float16) [out, ", sc_per_row, " per row] contiguous");
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  if (interleaved && (x.scalar_type() == at::kFloat || !bias)) {
    // bf16 activations (a bf16 model's) are read and written as they are: no conversion ops around a batch-1
    // step's matmuls. With a bias they take the float32 path below, so the sum is rounded to bf16 once.
    return KVMESH_DISPATCH_ACT(x.scalar_type(), "linear_gguf", [&] {
      at::Tensor out = half ? product_x<at::Half, T>(x, qp, scales.data_ptr<at::Half>(), N, fmt)
                            : product_x<float, T>(x, qp, scales.data_ptr<float>(), N, fmt);
      gemv::add_bias(out, bias);
      return out;
    });
  }
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = interleaved ? (half ? product_x<at::Half, float>(xf, qp, scales.data_ptr<at::Half>(), N, fmt)
                                       : product_x<float, float>(xf, qp, scales.data_ptr<float>(), N, fmt))
                 : half ? product(xf, qp, scales.data_ptr<at::Half>(), N, fmt, act)
                        : product(xf, qp, scales.data_ptr<float>(), N, fmt, act);
  gemv::add_bias(out, bias);
  return out.to(x.scalar_type());
}

int64_t gguf_q4x_lanes() {
  return kLanes;
}

TORCH_LIBRARY_FRAGMENT(kvmesh_cpu, m) {
  m.def("linear_gguf(Tensor x, Tensor qs, Tensor scales, Tensor? bias, int fmt, int act) -> Tensor");
  m.impl("linear_gguf", c10::DispatchKey::CPU, &linear_gguf);
  // The rows a kQ4X / kQ8X group interleaves in this build (pack_q4x's and pack_q8x's lanes).
  m.def("gguf_q4x_lanes() -> int", &gguf_q4x_lanes);
}

}  // namespace kvmesh
