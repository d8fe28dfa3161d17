"""FP8 (e4m3) W8A8 GEMM: out = (quantize(x) @ w^T) * x_scale * w_scale, with the activations quantized inside.

- w: float8_e4m3fn [N, K] with one float32 scale per output row (a per-tensor checkpoint scale is repeated per row
  at load, shared/models/fp8_linear.py);
- x: quantized per token (dynamic: scale = max|x_row| / 448) or with one static scale from the checkpoint;
  q = clamp(x / scale, +-448) rounded to e4m3 (round to nearest even), as torch's cast rounds.

On a GPU of sm_90+ with K and N multiples of 16 the product is torch._scaled_mm (cuBLASLt, row-wise scales)
after one quantization kernel (kernels/fp8_quant_rows.py); otherwise (sm_89, odd shapes) the Triton kernel here,
which reads each row block of x twice (its max, then the quantized tiles) so the activations are quantized in
registers and never written.

Triton's interpreter rounds float32 -> e4m3 wrongly (1.95 -> 1.0: the mantissa carry is lost), so under it the
kernel rounds by arithmetic instead (EMULATE_FP8): the same values the GPU's conversion gives.
"""
from __future__ import annotations

import torch

from kernels.fp8_quant_rows import FP8, FP8_MAX, quantize_fp8, quantize_fp8_rows_ref, quantize_fp8_static_ref
from kernels.triton_support import interpreting, recording, tl, triton

if triton is not None:
    from kernels.fp8_quant_rows import round_e4m3

__all__ = ["FP8", "FP8_MAX", "fp8_gemm", "fp8_gemm_ref", "fp8_gemm_triton"]

def fp8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin. x [M, K], weight float8 [N, K], weight_scale float32 [N], input_scale float32 [1] (static) or
    None (dynamic per token) -> [M, N] in x's dtype; the products summed in float32."""
    if input_scale is None:
        xq, xs = quantize_fp8_rows_ref(x)
    else:
        xq, xs = quantize_fp8_static_ref(x, input_scale), input_scale.float().expand(x.shape[0])
    acc = xq.float() @ weight.float().t()
    return (acc * xs[:, None] * weight_scale.float()[None, :]).to(x.dtype)


def check_fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None) -> None:
    assert x.dim() == 2, f"x must be [tokens, K], got {tuple(x.shape)}"
    assert weight.dtype == FP8 and weight.dim() == 2 and weight.shape[1] == x.shape[1], \
        f"weight must be float8_e4m3fn [N, {x.shape[1]}], got {weight.dtype} {tuple(weight.shape)}"
    assert weight_scale.dtype == torch.float32 and weight_scale.shape == (weight.shape[0],), \
        f"weight_scale must be float32 [{weight.shape[0]}], got {weight_scale.dtype} {tuple(weight_scale.shape)}"
    assert input_scale is None or (input_scale.dtype == torch.float32 and input_scale.numel() == 1), \
        "input_scale must be one float32 value"


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                         STATIC_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EMULATE_FP8: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        if STATIC_X:
            xs = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(xs_ptr)
        else:  # pass 1: each row's max |x|
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
            xs = tl.maximum(amax / 448.0, 1e-12 / 448.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            aq = tl.minimum(tl.maximum(a.to(tl.float32) / xs[:, None], -448.0), 448.0)
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if EMULATE_FP8:
                acc += tl.dot(round_e4m3(aq), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(aq.to(tl.float8e4nv), w)
        ws = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        out = acc * xs[:, None] * ws[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): fp8 dots take K tiles of 32+."""
    return (16, 64, 128) if m <= 16 else (32, 64, 128) if m <= 32 else (64, 128, 64)


def fp8_gemm_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    input_scale: torch.Tensor | None = None) -> torch.Tensor:
    check_fp8_gemm(x, weight, weight_scale, input_scale)
    assert triton is not None, "triton is not installed"
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, block_k = fp8_tiles(m)
        _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            x, weight, weight_scale, weight_scale if input_scale is None else input_scale, out, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0), STATIC_X=input_scale is not None, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_K=block_k, EMULATE_FP8=interpreting() and not recording(), num_warps=4)
    return out


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm with row-wise scales: CUDA sm_90+, bf16 output, K and N multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)


def fp8_gemm_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor | None = None) -> torch.Tensor:
    xq, xs = quantize_fp8(x, input_scale)  # one kernel (kernels/fp8_quant_rows.py)
    return torch._scaled_mm(xq, weight.t(), scale_a=xs.reshape(-1, 1),
                            scale_b=weight_scale.reshape(1, -1), out_dtype=x.dtype)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:
        if scaled_mm_fits(x, weight):
            return fp8_gemm_scaled_mm(x, weight, weight_scale, input_scale)
        return fp8_gemm_triton(x, weight, weight_scale, input_scale)
    if recording():  # kernels/aot.py: the launch is recorded (the kernel is what sm_89 and odd shapes run)
        fp8_gemm_triton(x, weight, weight_scale, input_scale)
    check_fp8_gemm(x, weight, weight_scale, input_scale)
    return fp8_gemm_ref(x, weight, weight_scale, input_scale)
