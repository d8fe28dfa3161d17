// Shared helpers of the CPU kernels (kernels/cpu/*.cpp): bf16 <-> float32 and the rounding the torch twins do.
// Every kernel computes in float32 and rounds to the activation dtype exactly where its twin's ops round, so the
// twin is the oracle. Only <ATen/ATen.h>: no pybind11, no torch/extension.h (build time on a 2-core CI box).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "thread_pool.h"

namespace kvmesh {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, NaN to a quiet NaN: c10::BFloat16's conversion, bit for bit.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// exp(x) in plain float ops the compiler vectorises inside `omp simd` loops (std::exp stays a scalar libm call
// there without -ffast-math, and it was most of the SiLU's and the softmax's time). Range reduction by ln 2 and a
// degree-6 polynomial: within ~2 float32 ulp of exp, like the vectorised exp torch's own kernels use.
inline float fast_exp(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365447504019f, x));
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += int32_t(n) << 23;
  std::memcpy(&p, &bits, 4);
  return p;
}

// Element access for the two activation dtypes: T is float or uint16_t (bf16 bits).
template <typename T> struct Act;
template <> struct Act<float> {
  static inline float load(const float* p) { return *p; }
  static inline void store(float* p, float v) { *p = v; }
  static inline float round(float v) { return v; }  // float32 ops round to float32: nothing to do
};
template <> struct Act<uint16_t> {
  static inline float load(const uint16_t* p) { return bf16_to_float(*p); }
  static inline void store(uint16_t* p, float v) { *p = float_to_bf16(v); }
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

template <typename T> inline T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

}  // namespace kvmesh

// Runs the lambda (which names T) with T = float or uint16_t (bf16 bits) for the dtype, as AT_DISPATCH does.
#define KVMESH_DISPATCH_ACT(st, what, ...)                                                   \
  [&] {                                                                                      \
    if ((st) == at::kFloat) {                                                                \
      using T = float;                                                                       \
      return __VA_ARGS__();                                                                  \
    }                                                                                        \
    TORCH_CHECK((st) == at::kBFloat16, what, ": float32 or bfloat16 activations only, got ", st); \
    using T = uint16_t;                                                                      \
    return __VA_ARGS__();                                                                    \
  }()
