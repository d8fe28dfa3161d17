// Shared parts of the decode matmul kernels (gemv_bf16.cpp, gemv_gguf.cpp): float32 activations times weights kept
// in a compact format (16-bit floats, GGUF blocks), converted to float32 (or multiplied as integers) in registers.
//
// Small steps (at most kMaxRows rows, every decode step and the C++ stack's short chunks) go through over_rows:
// parallel over output rows (thread_pool.h's parallel_for on the engine's threads), each weight row read from
// memory once for all the step's rows, in passes of up to kRowBlock activation rows whose accumulators stay in
// registers. over_blocks does the same a block of weight rows at a time (16-bit weights' larger steps, where the
// arithmetic, not the weight traffic, bounds the step).
// Larger steps (prefill) go through tiled: a tile of the weight (about 2 MiB) dequantized to float32 at a time and
// multiplied by at::mm, so no float32 copy of the whole weight ever exists.
#pragma once
#include <algorithm>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "common.h"

namespace kvmesh {
namespace gemv {

constexpr int64_t kMaxRows = 16;
constexpr int kRowBlock = 4;

#if defined(__AVX2__) && defined(__FMA__)
#define KVMESH_GEMV_AVX2 1
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[m, n] for m < M, n < N: fn(std::integral_constant<int, RB>, n, m0) fills rows m0 .. m0 + RB - 1 of column n.
template <typename F>
void over_rows(int64_t M, int64_t N, int64_t weight_row_bytes, F&& fn) {
  // Tasks of at least ~32 KiB of weights: below that the fork/join costs more than the rows.
  const int64_t grain = std::max<int64_t>(1, (int64_t(32) << 10) / std::max<int64_t>(1, weight_row_bytes));
  parallel_for(0, N, grain, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      int64_t m = 0;
      for (; m + kRowBlock <= M; m += kRowBlock) fn(std::integral_constant<int, kRowBlock>(), n, m);
      switch (M - m) {
        case 3: fn(std::integral_constant<int, 3>(), n, m); break;
        case 2: fn(std::integral_constant<int, 2>(), n, m); break;
        case 1: fn(std::integral_constant<int, 1>(), n, m); break;
        default: break;
      }
    }
  });
}

// One activation row against the weight two output rows at a time (kernels that interleave two rows' chains):
// fn(std::integral_constant<int, NW>(), n) fills outputs n .. n + NW - 1, NW 2 (1 for an odd last row).
template <typename F>
void over_row_pairs(int64_t N, int64_t weight_row_bytes, F&& fn) {
  const int64_t grain = std::max<int64_t>(1, ((int64_t(32) << 10) / std::max<int64_t>(1, weight_row_bytes) + 1) / 2);
  parallel_for(0, (N + 1) / 2, grain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      if (2 * i + 2 <= N) {
        fn(std::integral_constant<int, 2>(), 2 * i);
      } else {
        fn(std::integral_constant<int, 1>(), 2 * i);
      }
    }
  });
}

// Calls fn(std::integral_constant<int, V>()) for the runtime value 1 <= v <= Max (kernels take their block shape
// as a compile-time constant so the accumulators stay in registers).
template <int Max, typename F>
inline void with_constant(int v, F&& fn) {
  if constexpr (Max >= 1) {
    if (v == Max) {
      fn(std::integral_constant<int, Max>());
    } else {
      with_constant<Max - 1>(v, fn);
    }
  }
}

// out[m, n] for m < M, n < N in blocks of up to NW output columns (weight rows) by RB activation rows:
// fn(std::integral_constant<int, nw>(), std::integral_constant<int, rb>(), n0, m0) fills rows m0 .. m0 + rb - 1
// of columns n0 .. n0 + nw - 1. Each weight block is read from memory once for all M rows (it stays in L1 between
// the row passes); the activations, M rows of K, are read once per weight block from the cache.
template <int NW, int RB, typename F>
void over_blocks(int64_t M, int64_t N, int64_t weight_row_bytes, F&& fn) {
  const int64_t groups = (N + NW - 1) / NW;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(32) << 10) / std::max<int64_t>(1, weight_row_bytes * NW));
  parallel_for(0, groups, grain, [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g) {
      const int64_t n0 = g * NW;
      with_constant<NW>(int(std::min<int64_t>(NW, N - n0)), [&](auto nw) {
        int64_t m = 0;
        for (; m + RB <= M; m += RB) fn(nw, std::integral_constant<int, RB>(), n0, m);
        if (m < M) with_constant<RB>(int(M - m), [&](auto rb) { fn(nw, rb, n0, m); });
      });
    }
  });
}

// x [M, K] float32 times the weight whose rows [n0, n1) dequant(n0, n1, dst) writes to dst as float32 rows.
template <typename F>
at::Tensor tiled(const at::Tensor& x, int64_t N, int64_t K, F&& dequant) {
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const int64_t T = std::min<int64_t>(N, std::max<int64_t>(16, (int64_t(1) << 19) / K));  // 2 MiB of float32
  at::Tensor tile = at::empty({T, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += T) {
    const int64_t tn = std::min(T, N - n0);
    at::Tensor t = tile.narrow(0, 0, tn);
    float* dst = t.data_ptr<float>();
    // On torch's team, like the at::mm that follows each tile: alternating the two pools would hand the cores
    // back and forth (each waking the other) twice a tile.
    at::parallel_for(0, tn, 8, [&](int64_t a, int64_t b) { dequant(n0 + a, n0 + b, dst + a * K); });
    out.narrow(1, n0, tn).copy_(at::mm(x, t.t()));
  }
  return out;
}

inline void add_bias(at::Tensor& out, const std::optional<at::Tensor>& bias) {
  if (bias) out.add_(*bias);
}

}  // namespace gemv
}  // namespace kvmesh
