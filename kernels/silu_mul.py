"""Fused SiLU-and-multiply of the gated MLP: out = silu(gate) * up for x = [gate | up] (the fused gate/up
projection's output), one kernel instead of three (silu, a multiply, and the strided split copies).

Numerics follow transformers' LlamaMLP in the activation dtype: silu rounded to the dtype, then the product
rounded to it; the arithmetic itself in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_support import recording, tl, triton


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch twin. x [tokens, 2 * inter] -> [tokens, inter]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
        """One program = one row x BLOCK output columns. N (the intermediate size) is a runtime argument: one
        compiled variant serves every model (tests/kernel_launches.py drives a small MLP for that reason)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
        dt = gate.dtype
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(dt), mask=mask)


def silu_mul_triton(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    check_silu_mul(x)
    assert triton is not None, "triton is not installed"
    assert x.stride(-1) == 1, "rows must be contiguous"
    tokens, n2 = x.shape
    out = torch.empty(tokens, n2 // 2, dtype=x.dtype, device=x.device)
    if tokens:
        n = n2 // 2
        _silu_mul_kernel[(tokens, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out


def check_silu_mul(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [tokens, 2 * inter], got {tuple(x.shape)}"


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return silu_mul_triton(x)
    if recording():  # kernels/aot.py: the launch is recorded, the twin computes
        silu_mul_triton(x)
    check_silu_mul(x)
    return silu_mul_ref(x)
