"""Store-KV: write this step's K/V into their cache slots (slot -1 skipped), quantizing for an FP8 cache.

Contract: k, v [tokens, kv_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
of the model dtype or torch.float8_e4m3fn; slot = block_id * block_size + offset. An FP8 cache holds
x / scale (saturated to the e4m3 range); readers multiply by the same per-tensor scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8_bytes import indexable
from kernels.triton_support import recording, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@dataclass(frozen=True)
class KeptSlots:
    """A step's slot_mapping without its -1 rows, as index_copy_ takes it: the same in every layer, so the CPU
    path derives it once per step (AttentionMetadata.cpu_cache) instead of four ops and a sync per layer."""
    slots: torch.Tensor  # [kept] int64
    keep: torch.Tensor | None  # [tokens] bool, None when every row is kept


def kept_slots(slot_mapping: torch.Tensor) -> KeptSlots:
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return KeptSlots(slot_mapping.long(), None)
    return KeptSlots(slot_mapping[keep].long(), keep)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                 kept: KeptSlots | None = None) -> None:
    """Torch twin (the CPU path and the oracle). Under torch.compile it runs as one opaque op (below): which
    rows it keeps depends on the slots' values, which a compiled graph cannot branch on. kept: kept_slots(
    slot_mapping), computed once per step by the caller (otherwise here)."""
    if torch.compiler.is_compiling():
        torch.ops.kvmesh.store_kv_cpu(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    if kept is None:
        kept = kept_slots(slot_mapping)
    if kept.keep is not None:
        k, v = k[kept.keep], v[kept.keep]
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8_DTYPE:
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    # FP8 as bytes (kernels/fp8_bytes.py).
    indexable(kf).index_copy_(0, kept.slots, indexable(k.to(kf.dtype)))
    indexable(vf).index_copy_(0, kept.slots, indexable(v.to(vf.dtype)))


@torch.library.custom_op("kvmesh::store_kv_cpu", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def _store_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """The twin as one op a compiled CPU decode step calls (shared/engine/cpu_compile.py)."""
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@_store_kv_cpu.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> None:
    return None


def check_store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    assert k.dim() == 3 and k.shape == v.shape, f"k/v must be [tokens, kv_heads, head_dim], got {k.shape}/{v.shape}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [blocks, block_size, kv_heads, head_dim]"
    assert k.shape[1:] == k_cache.shape[2:], f"k {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}"
    assert slot_mapping.shape == (k.shape[0],), f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}"
    assert k_cache.dtype in (k.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs k dtype {k.dtype}"


if triton is not None:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_scale, v_scale,
                         stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cb, stride_ct, stride_ch, stride_vcb, stride_vct, stride_vch,
                         BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         H_PAD: tl.constexpr, D_PAD: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
        """One program per token: all its KV heads at once; slot -1 writes nothing."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            h = tl.arange(0, H_PAD)
            d = tl.arange(0, D_PAD)
            mask = (h[:, None] < KV_HEADS) & (d[None, :] < HEAD_DIM)
            k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
            v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
            if IS_FP8:
                k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
                v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
            kc = kc_ptr + blk * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :]
            vc = vc_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :]
            tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    assert triton is not None, "triton is not installed"
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1, \
        "head_dim must be contiguous"
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], KV_HEADS=kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), IS_FP8=k_cache.dtype == FP8_DTYPE, FP8_MAX=FP8_MAX)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    if k.is_cuda:
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
