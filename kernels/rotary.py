"""Rotary position embedding applied in place to q and k (rotate-half convention of the HF Llama family).

The scaling type (default, linear, llama3) lives in the cos/sin table (shared/models/rope.py builds it);
the kernel only gathers the table at each token's position.
"""
from __future__ import annotations

import torch

from kernels.triton_support import recording, tl, triton


def rope_rows(cos_sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one step, [tokens, 1, head_dim] each in the activation dtype: (cos | cos, -sin | sin). The
    same for every layer, so the CPU path gathers and casts them once per step (AttentionMetadata.cpu_cache)
    instead of once per layer and tensor."""
    cos_sin = cos_sin_cache[positions]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    return torch.cat([cos, cos], -1).to(dtype)[:, None], torch.cat([-sin, sin], -1).to(dtype)[:, None]


def rotate_rows(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> None:
    """x [tokens, heads, head_dim] rotated in place by rope_rows(...): x * (cos | cos) + (x2 | x1) * (-sin | sin),
    four ops. Each product and the sum round to the activation dtype as the rotate-half formula's (x1 cos - x2 sin,
    x2 cos + x1 sin) do, and negating is exact, so the result is bit-identical to it."""
    cos, sin = rows
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # (x2 | x1), a copy
    swapped.mul_(sin)
    x.mul_(cos).add_(swapped)


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Torch twin. q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim], positions [tokens],
    cos_sin_cache [max_positions, head_dim] float32 (cos in the first half, sin in the second)."""
    rows = rope_rows(cos_sin_cache, positions, q.dtype)
    rotate_rows(q, rows)
    rotate_rows(k, rows)


if triton is not None:

    @triton.jit
    def _rotary_kernel(x_ptr, pos_ptr, cs_ptr, stride_xt, stride_xh, stride_cs,
                       HEADS: tl.constexpr, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        """One program per token: every head of x rotated by the cos/sin row of the token's position."""
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        i = tl.arange(0, HALF_PAD)
        h = tl.arange(0, H_PAD)
        i_ok = i < HALF
        cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i_ok, other=0.0)
        sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i_ok, other=0.0)
        mask = (h[:, None] < HEADS) & i_ok[None, :]
        base = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        # Same rounding as the twin (and transformers): cos/sin rounded to the activation dtype, each product
        # and sum rounded to it too; the arithmetic itself in float32.
        dt = x1.dtype
        c = cos.to(dt).to(tl.float32)[None, :]
        s = sin.to(dt).to(tl.float32)[None, :]
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        out1 = (a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)
        out2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
        tl.store(base, out1.to(dt), mask=mask)
        tl.store(base + HALF, out2.to(dt), mask=mask)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    check_rotary(q, k, positions, cos_sin_cache)
    assert triton is not None, "triton is not installed"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1, "head_dim must be contiguous"
    tokens, _, head_dim = q.shape
    if tokens == 0:
        return
    half = head_dim // 2
    for x in (q, k):
        _rotary_kernel[(tokens,)](x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0),
                                  HEADS=x.shape[1], HALF=half, H_PAD=triton.next_power_of_2(x.shape[1]),
                                  HALF_PAD=triton.next_power_of_2(half))


def check_rotary(q, k, positions, cos_sin_cache) -> None:
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], \
        f"q {tuple(q.shape)} / k {tuple(k.shape)} must be [tokens, heads, head_dim]"
    assert positions.shape == (q.shape[0],), f"positions must be [{q.shape[0]}]"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == q.shape[2], "cos_sin_cache must be [P, head_dim]"


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    if q.is_cuda:
        return rotary_triton(q, k, positions, cos_sin_cache)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        rotary_triton(q, k, positions, cos_sin_cache)
    check_rotary(q, k, positions, cos_sin_cache)
    rotary_ref(q, k, positions, cos_sin_cache)
