"""Store-KV: write this step's K/V into their cache slots (slot -1 skipped), quantizing for an FP8 cache.

Contract: k, v [tokens, kv_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
of the model dtype or torch.float8_e4m3fn; slot = block_id * block_size + offset. An FP8 cache holds
x / scale (saturated to the e4m3 range); readers multiply by the same per-tensor scale.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Torch twin (the CPU path and the oracle)."""
    keep = slot_mapping >= 0
    slots = slot_mapping
    if not bool(keep.all()):
        slots, k, v = slot_mapping[keep], k[keep], v[keep]
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    kf.index_copy_(0, slots.long(), k.to(k_cache.dtype))
    vf.index_copy_(0, slots.long(), v.to(v_cache.dtype))


def check_store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    assert k.dim() == 3 and k.shape == v.shape, f"k/v must be [tokens, kv_heads, head_dim], got {k.shape}/{v.shape}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert k.shape[1:] == k_cache.shape[2:], f"k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}"
    assert slot_mapping.shape == (k.shape[0],), f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}"
    assert k_cache.dtype in (k.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs k dtype {k.dtype}"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
