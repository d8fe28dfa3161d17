"""Wrapper of qk_rope_store.cpp (oracle: kernels/qk_rope_store.py's qk_rope_store_ref). The cache must be in the
activation dtype (an FP8 cache stays on the twin)."""
from __future__ import annotations

import torch

from kernels.qk_rope_store import check_qk_rope_store


def qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache, v_cache,
                  slot_mapping) -> torch.Tensor:
    check_qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, positions, cos_sin_cache, k_cache, v_cache,
                        slot_mapping)
    assert k_cache.dtype == qkv.dtype, f"the C++ kernel stores {qkv.dtype} caches, got {k_cache.dtype}"
    assert positions.dtype == slot_mapping.dtype == torch.int32 and cos_sin_cache.dtype == torch.float32
    return torch.ops.kvmesh_cpu.qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions,
                                              cos_sin_cache, k_cache, v_cache, slot_mapping)
