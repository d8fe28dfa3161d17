"""Dequantize a 4-bit weight (kernels/w4a16_layout.py) to a dense [K, N] matrix in the activations' dtype.

w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n], computed in float32 (exact) and rounded once to the output dtype:
the same values the W4A16 GEMM multiplies by. It serves long steps: measured on an H200 at Llama-3.1-8B's gate/up
layer (4096 x 28672), the register-dequantizing GEMM took 0.42 ms at 256 tokens and 25 ms at 16,384, against 0.10
and 4.8 ms for bf16 `F.linear`; writing the weight out once per step (0.5 byte read, 2 written per value) and
multiplying densely costs far less than the GEMM's extra time there. vLLM's AWQ path makes the same switch.
"""
from __future__ import annotations

import torch

from kernels.triton_support import interpreting, recording, tl, triton
from kernels.w4a16_layout import BLOCK_K, check_w4a16_weight, w4a16_dequantize

BLOCK_N = 128


def w4a16_dequant_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                      g_idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Torch twin: [K, N] in dtype."""
    return w4a16_dequantize(qweight, scales, zeros, group, g_idx).to(dtype)


if triton is not None:

    @triton.jit
    def dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, n_mask, k0, N, GROUP: tl.constexpr,
                     HAS_G_IDX: tl.constexpr):
        """The float32 weight of rows offs_k (from k0, within one group unless HAS_G_IDX) x columns offs_n:
        what both 4-bit kernels multiply by."""
        words = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :],
                        other=0)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            g = tl.load(g_ptr + offs_k).to(tl.int64)
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0.0)
            z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        else:
            g = k0 // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0)[None, :]
        return (q - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)

    @triton.jit
    def _w4a16_dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, GROUP: tl.constexpr,
                              HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                              EMULATE_BF16: tl.constexpr):
        """Program (k, n): rows BLOCK_K x columns BLOCK_N of the output; BLOCK_K divides GROUP, so without a
        per-row group index the tile's rows share one group."""
        pid_k, pid_n = tl.program_id(0), tl.program_id(1)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w = dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, n_mask, pid_k * BLOCK_K, N, GROUP, HAS_G_IDX)
        if EMULATE_BF16:  # round to nearest even by the bits first; the interpreter's cast would truncate
            u = w.to(tl.uint32, bitcast=True)
            w = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(out_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=n_mask[None, :])


def w4a16_dequant_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                         g_idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    check_w4a16_weight(qweight, scales, zeros, group, g_idx)
    assert triton is not None, "triton is not installed"
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    _w4a16_dequant_kernel[(k // BLOCK_K, triton.cdiv(n, BLOCK_N))](
        qweight, scales, zeros, qweight if g_idx is None else g_idx, out, n,
        GROUP=group if g_idx is None else BLOCK_K, HAS_G_IDX=g_idx is not None, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
        EMULATE_BF16=interpreting() and not recording() and dtype == torch.bfloat16, num_warps=4)
    return out


def w4a16_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                  g_idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The dispatch: the kernel on CUDA, the twin elsewhere."""
    if qweight.is_cuda:
        return w4a16_dequant_triton(qweight, scales, zeros, group, g_idx, dtype)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        w4a16_dequant_triton(qweight, scales, zeros, group, g_idx, dtype)
    check_w4a16_weight(qweight, scales, zeros, group, g_idx)
    return w4a16_dequant_ref(qweight, scales, zeros, group, g_idx, dtype)
