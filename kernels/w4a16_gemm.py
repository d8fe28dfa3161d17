"""4-bit weight, 16-bit activation GEMM (AWQ and GPTQ checkpoints, repacked at load into kernels/w4a16_layout.py's
layout): x [M, K] @ w [K, N] with w dequantized in float32 and rounded once to x's dtype for the tensor-core dot.

The Triton kernel dequantizes a [BLOCK_K, BLOCK_N] tile in registers and multiplies; small batches split K across
programs (SPLIT_K) so that a decode step at batch 1 still spreads over every SM (as vLLM's Triton AWQ kernel and
Marlin do), partial sums in float32 reduced after.
"""
from __future__ import annotations

import torch

from kernels.triton_support import recording, tl, triton, upcast_dot
from kernels.w4a16_dequant import w4a16_dequant
from kernels.w4a16_layout import BLOCK_K, PACK, check_w4a16_weight, w4a16_dequantize

# Steps of at least this many tokens dequantize the weight once (kernels/w4a16_dequant.py) and multiply densely:
# measured on an H200 at Llama-3.1-8B's layers, the register-dequantizing kernel took 2-5x bf16's time there.
DENSE_ROWS = 256


def w4a16_gemm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                   g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin. x [M, K] -> [M, N] in x's dtype: x @ dequantized weight (rounded to x's dtype)."""
    w = w4a16_dequantize(qweight, scales, zeros, group, g_idx).to(x.dtype)
    return x @ w


def check_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                g_idx: torch.Tensor | None) -> None:
    assert x.dim() == 2, f"x must be [tokens, K], got {tuple(x.shape)}"
    assert qweight.shape[0] * PACK == x.shape[1], f"qweight {tuple(qweight.shape)} does not hold K = {x.shape[1]} rows"
    check_w4a16_weight(qweight, scales, zeros, group, g_idx)


if triton is not None:
    from kernels.w4a16_dequant import dequant_tile

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_os,
                      GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr):
        """Program (m, n, s): rows BLOCK_M x columns BLOCK_N over the s-th of SPLIT_K equal runs of K; float32
        partial sums to out[s]. BLOCK_K divides GROUP, so a tile's rows share one group unless HAS_G_IDX."""
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        k_run = K // SPLIT_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_s * k_run, (pid_s + 1) * k_run, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=m_mask[:, None],
                        other=0.0)
            w = dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, n_mask, k0, N, GROUP, HAS_G_IDX)
            if UPCAST:  # the interpreter's bf16 dot is wrong: round as the GPU would, multiply in float32
                acc += tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
        tl.store(out_ptr + pid_s * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc,
                 mask=m_mask[:, None] & n_mask[None, :])


def w4a16_tiles(m: int, n: int, k: int, sms: int = 132, g_idx: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT_K) for an M x N x K product: small M splits K until the grid covers the SMs
    about twice (K stays a multiple of SPLIT_K * BLOCK_K). A per-row group index loads [BLOCK_K, BLOCK_N] scales
    and zeros: its large tiles stay 64 columns wide (128 spilled on sm_80)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 or g_idx else 128
    tiles = -(-m // block_m) * -(-n // block_n)
    split = 1
    while split < 16 and tiles * split < 2 * sms and k % (2 * split * BLOCK_K) == 0:
        split *= 2
    return block_m, block_n, split


def w4a16_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                      g_idx: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    check_w4a16(x, qweight, scales, zeros, group, g_idx)
    assert triton is not None, "triton is not installed"
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    block_m, block_n, split = tiles or w4a16_tiles(m, n, k, g_idx=g_idx is not None)
    assert k % (split * BLOCK_K) == 0, f"K = {k} does not split {split} ways into {BLOCK_K}-row tiles"
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
        _w4a16_kernel[grid](x, qweight, scales, zeros, qweight if g_idx is None else g_idx, part, m, n, k,
                            x.stride(0), part.stride(1), part.stride(0), GROUP=group if g_idx is None else BLOCK_K,
                            HAS_G_IDX=g_idx is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                            SPLIT_K=split, UPCAST=upcast_dot(x.dtype), num_warps=4)
    return (part[0] if split == 1 else part.sum(0)).to(x.dtype)


def dense_step(m: int) -> bool:
    """Whether an M-token step on CUDA multiplies by the dequantized weight. Never inside a CUDA graph capture:
    the transient [K, N] weight would stay in the graphs' memory pool."""
    return m >= DENSE_ROWS and not torch.cuda.is_current_stream_capturing()


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        if dense_step(x.shape[0]):
            check_w4a16(x, qweight, scales, zeros, group, g_idx)
            return x @ w4a16_dequant(qweight, scales, zeros, group, g_idx, x.dtype)
        return w4a16_gemm_triton(x, qweight, scales, zeros, group, g_idx)
    if recording():  # kernels/aot.py: the launch a GPU would make is recorded, the twin computes
        if x.shape[0] >= DENSE_ROWS:
            w4a16_dequant(qweight, scales, zeros, group, g_idx, x.dtype)
        else:
            w4a16_gemm_triton(x, qweight, scales, zeros, group, g_idx)
    check_w4a16(x, qweight, scales, zeros, group, g_idx)
    return w4a16_gemm_ref(x, qweight, scales, zeros, group, g_idx)
