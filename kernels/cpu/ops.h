// The CPU kernels' C++ entry points, called by their own ops (one per .cpp) and by the decoder stack.
#pragma once
#include <ATen/ATen.h>
#include <optional>

namespace kvmesh {

// out = rms_norm(x) [* weight]; with residual: residual <- x + residual first, and the norm is of that sum.
// x, residual, out: [rows, hidden] contiguous rows; out may alias x.
void rms_norm_into(const at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                   const at::Tensor& weight, double eps);

// q [tokens, heads, head_dim] (returned) from qkv rows: optional per-head q/k RMSNorm, rotary, k/v stored at
// their slots (slot -1 skipped).
at::Tensor qk_rope_store(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                         double eps, const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping);

// silu(gate) * up for x = [gate | up].
at::Tensor silu_mul(const at::Tensor& x);

// Every query row over the paged cache: rows [0, num_prefill_tokens) are prompt chunks (query_start offsets into
// prefill_context_lens / prefill_block_tables, causal within the chunk), the rest one decode row per sequence.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           int64_t num_prefill_tokens, const at::Tensor& query_start,
                           const at::Tensor& prefill_context_lens, const at::Tensor& prefill_block_tables,
                           const at::Tensor& decode_context_lens, const at::Tensor& decode_block_tables, double scale,
                           int64_t sliding_window);

// x [rows, in] float32 times w [out, in] bfloat16 or float16 (widened in registers), plus bias: [rows, out] float32.
at::Tensor linear_w16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// x [rows, in] bfloat16 times a weight packed by gemv_dpbf16.py's pack_dpbf16 (AVX512-BF16 builds only), plus
// bias: [rows, out] bfloat16.
at::Tensor linear_dpbf16(const at::Tensor& x, const at::Tensor& w, int64_t out_features,
                         const std::optional<at::Tensor>& bias);

// x [rows, in] float32 or bfloat16 times a weight in GGUF blocks (gemv_gguf.cpp: fmt 0 Q4_0/Q4_1, 1 Q8_0, 2 Q6_K,
// 3 / 4 Q4 / Q8_0 rows interleaved; act 0 float32 activations, 1 int8 activations), plus bias: [rows, out] in x's
// dtype.
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t fmt, int64_t act);

}  // namespace kvmesh
