"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow transformers' LlamaRMSNorm: the residual add happens in the activation dtype, the
normalisation in float32, the result is cast back to the activation dtype before the weight multiply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_support import recording, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch twin. x [..., hidden]; weight [hidden]."""
    if x.dtype == torch.float32:
        # Fused kernel, bit-identical to transformers' formula in float32 and ~2x faster on CPU.
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: residual' = x + residual; returns (rms_norm(residual'), residual')."""
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                         N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """One program per row. With a residual: res <- x + res (in the activation dtype), then the norm of it."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        # Arithmetic in float32, rounded to the activation dtype where torch rounds (after the add, after the
        # normalisation, after the weight), so half-precision results match the twin bit for bit or nearly.
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        xf = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x = (xf + r.to(tl.float32)).to(dtype)
            tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
            xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / N
        normed = (xf * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm(x, weight)
    assert triton is not None, "triton is not installed"
    rows = _rows(x)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        n = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, rows.stride(0), rows.stride(0), out.stride(0),
                                           eps, N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False)
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual); returns (x, residual)."""
    check_rms_norm(x, weight)
    assert triton is not None, "triton is not installed"
    assert x.is_contiguous() and residual.is_contiguous(), "add_rms_norm works in place on contiguous tensors"
    rows, res = x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1])
    if rows.shape[0]:
        n = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, rows, rows.stride(0), res.stride(0), rows.stride(0),
                                           eps, N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=True)
    return x, residual


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert weight.dim() == 1 and x.shape[-1] == weight.shape[0], f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        rms_norm_triton(x, weight, eps)
    check_rms_norm(x, weight)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). May overwrite x and residual in place (the Triton version
    does, to avoid allocations): callers must not reuse either afterwards."""
    if x.is_cuda:
        return add_rms_norm_triton(x, residual, weight, eps)
    if recording():  # kernels/aot.py: the launch is recorded (it would work in place), the twin computes
        add_rms_norm_triton(x, residual, weight, eps)
    check_rms_norm(x, weight)
    assert x.shape == residual.shape and x.dtype == residual.dtype, "x and residual must match"
    return add_rms_norm_ref(x, residual, weight, eps)
