"""The attention's prologue fused: from the fused q/k/v projection's rows, per-head RMSNorm of q and k (Qwen3's
q/k norm, optional), rotary on q and k, then k and v stored into their cache slots (FP8 quantized with a
scale, slot -1 skipped). One kernel and one read of each row instead of a strided copy, two norms, two
rotary launches and a store.

Contract: qkv [tokens, (heads + 2 * kv_heads) * head_dim] (rows contiguous in their last dim; its q and k
parts are overwritten), positions [tokens], cos_sin_cache [max_positions, head_dim] float32 (cos, sin
halves), q_weight / k_weight [head_dim] or None, caches [num_blocks, block_size, kv_heads, head_dim].
Returns q [tokens, heads, head_dim], normed and rotated. Numerics are those of the unfused kernels (each
rounding to the activation dtype where they round), whose twins, composed, are this kernel's twin.
"""
from __future__ import annotations

import torch

from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import rope_rows, rotate_rows
from kernels.store_kv import FP8_DTYPE, FP8_MAX, store_kv_ref
from kernels.triton_support import recording, tl, triton


def _views(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    t = qkv.shape[0]
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(t, kv_heads, head_dim)
    return q, k, v


def qk_rope_store_ref(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache,
                      v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, rope=None, kept=None) -> torch.Tensor:
    """Torch twin (the CPU path and the oracle): the unfused kernels' twins in their order. rope / kept: the
    step's kernels.rotary.rope_rows / kernels.store_kv.kept_slots, computed once per step by the caller (otherwise
    here)."""
    q, k, v = _views(qkv, heads, kv_heads, head_dim)
    if rope is None:
        rope = rope_rows(cos_sin_cache, positions, qkv.dtype)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
        rotate_rows(q, rope)
        rotate_rows(k, rope)
    else:
        # q and k sit side by side in each row: one rotation over both, half the ops of one each.
        rotate_rows(qkv[:, : (heads + kv_heads) * head_dim].view(qkv.shape[0], heads + kv_heads, head_dim), rope)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, kept)
    return q


if triton is not None:

    @triton.jit
    def _norm_rope(x1, x2, w_ptr, c, s, eps, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr):
        """x1, x2 [heads, HALF_PAD] halves of each head (activation dtype) -> rotated halves in float32, each
        value rounded to the activation dtype where the unfused kernels round."""
        dt = x1.dtype
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        if HAS_NORM:
            i = tl.arange(0, HALF_PAD)
            w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
            var = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF)
            r = tl.rsqrt(var + eps)[:, None]
            a1 = ((a1 * r).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
            a2 = ((a2 * r).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
        out1 = (a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)
        out2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
        return out1, out2

    @triton.jit
    def _qk_rope_store_kernel(
        qkv_ptr, q_out_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr,
        eps, k_scale, v_scale, stride_t, stride_qo, stride_cs,
        stride_cb, stride_ct, stride_ch, stride_vcb, stride_vct, stride_vch,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr,
        KH_PAD: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_NORM: tl.constexpr,
        IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    ):
        """One program per token: all its query heads, then its KV heads (stored into the cache slot)."""
        t = tl.program_id(0).to(tl.int64)
        D: tl.constexpr = 2 * HALF
        pos = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        i_ok = i < HALF
        row = qkv_ptr + t * stride_t
        # q
        h = tl.arange(0, H_PAD)
        qm = (h[:, None] < HEADS) & i_ok[None, :]
        q1 = tl.load(row + h[:, None] * D + i[None, :], mask=qm, other=0.0)
        q2 = tl.load(row + h[:, None] * D + HALF + i[None, :], mask=qm, other=0.0)
        dt = q1.dtype
        cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i_ok, other=0.0).to(dt).to(tl.float32)[None, :]
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0).to(dt).to(tl.float32)[None, :]
        o1, o2 = _norm_rope(q1, q2, qw_ptr, cos, sin, eps, HALF, HALF_PAD, HAS_NORM)
        qo = q_out_ptr + t * stride_qo + h[:, None] * D + i[None, :]
        tl.store(qo, o1.to(dt), mask=qm)
        tl.store(qo + HALF, o2.to(dt), mask=qm)
        # k, v: into the cache slot (nothing for slot -1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            kh = tl.arange(0, KH_PAD)
            km = (kh[:, None] < KV_HEADS) & i_ok[None, :]
            kbase = row + HEADS * D + kh[:, None] * D + i[None, :]
            k1, k2 = _norm_rope(tl.load(kbase, mask=km, other=0.0), tl.load(kbase + HALF, mask=km, other=0.0), kw_ptr,
                                cos, sin, eps, HALF, HALF_PAD, HAS_NORM)
            vbase = row + (HEADS + KV_HEADS) * D + kh[:, None] * D + i[None, :]
            v1 = tl.load(vbase, mask=km, other=0.0).to(tl.float32)
            v2 = tl.load(vbase + HALF, mask=km, other=0.0).to(tl.float32)
            k1 = k1.to(dt).to(tl.float32)
            k2 = k2.to(dt).to(tl.float32)
            if IS_FP8:
                k1 = tl.clamp(k1 / k_scale, -FP8_MAX, FP8_MAX)
                k2 = tl.clamp(k2 / k_scale, -FP8_MAX, FP8_MAX)
                v1 = tl.clamp(v1 / v_scale, -FP8_MAX, FP8_MAX)
                v2 = tl.clamp(v2 / v_scale, -FP8_MAX, FP8_MAX)
            kc = kc_ptr + blk * stride_cb + off * stride_ct + kh[:, None] * stride_ch + i[None, :]
            vc = vc_ptr + blk * stride_vcb + off * stride_vct + kh[:, None] * stride_vch + i[None, :]
            tl.store(kc, k1.to(kc_ptr.dtype.element_ty), mask=km)
            tl.store(kc + HALF, k2.to(kc_ptr.dtype.element_ty), mask=km)
            tl.store(vc, v1.to(vc_ptr.dtype.element_ty), mask=km)
            tl.store(vc + HALF, v2.to(vc_ptr.dtype.element_ty), mask=km)


def qk_rope_store_triton(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache,
                         v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    check_qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, positions, cos_sin_cache, k_cache, v_cache,
                        slot_mapping)
    assert triton is not None, "triton is not installed"
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    has_norm = q_weight is not None
    half = head_dim // 2
    _qk_rope_store_kernel[(tokens,)](
        qkv, q, positions, cos_sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        k_cache, v_cache, slot_mapping, eps, float(k_scale), float(v_scale),
        qkv.stride(0), q.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, H_PAD=triton.next_power_of_2(heads),
        KH_PAD=triton.next_power_of_2(kv_heads), HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, IS_FP8=k_cache.dtype == FP8_DTYPE, FP8_MAX=FP8_MAX)
    return q


def check_qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, positions, cos_sin_cache, k_cache, v_cache,
                        slot_mapping) -> None:
    assert qkv.dim() == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * head_dim, \
        f"qkv must be [tokens, {(heads + 2 * kv_heads) * head_dim}], got {tuple(qkv.shape)}"
    assert qkv.stride(1) == 1 and head_dim % 2 == 0, "rows must be contiguous and head_dim even"
    assert (q_weight is None) == (k_weight is None), "q and k norms come together"
    assert q_weight is None or (q_weight.shape == (head_dim,) and k_weight.shape == (head_dim,)), "norm weights [head_dim]"
    assert positions.shape == (qkv.shape[0],), f"positions must be [{qkv.shape[0]}]"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim and cos_sin_cache.stride(1) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim), \
        f"caches must be [blocks, block_size, {kv_heads}, {head_dim}], got {tuple(k_cache.shape)}"
    assert slot_mapping.shape == (qkv.shape[0],), f"slot_mapping must be [{qkv.shape[0]}]"
    assert k_cache.dtype in (qkv.dtype, FP8_DTYPE), f"cache dtype {k_cache.dtype} vs qkv dtype {qkv.dtype}"


def qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache, v_cache,
                  slot_mapping, k_scale=1.0, v_scale=1.0, rope=None, kept=None) -> torch.Tensor:
    """rope / kept: on CPU, the step's kernels.rotary.rope_rows(cos_sin_cache, positions, qkv.dtype) and
    kernels.store_kv.kept_slots(slot_mapping), computed once for all layers (ignored on CUDA, where the kernel reads
    the table and the slots)."""
    args = (qkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, cos_sin_cache, k_cache, v_cache,
            slot_mapping, k_scale, v_scale)
    if qkv.is_cuda:
        return qk_rope_store_triton(*args)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        qk_rope_store_triton(*args)
    check_qk_rope_store(qkv, heads, kv_heads, head_dim, q_weight, k_weight, positions, cos_sin_cache, k_cache, v_cache,
                        slot_mapping)
    return qk_rope_store_ref(*args, rope=rope, kept=kept)
