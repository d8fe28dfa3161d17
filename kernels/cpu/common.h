// Shared helpers of the CPU kernels (kernels/cpu/*.cpp): bf16 <-> float32 and the rounding the torch twins do.
// Every kernel computes in float32 and rounds to the activation dtype exactly where its twin's ops round, so the
// twin is the oracle. Only <ATen/ATen.h>: no pybind11, no torch/extension.h (build time on a 2-core CI box).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>

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
