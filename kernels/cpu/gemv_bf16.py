"""Wrapper of gemv_bf16.cpp: float32 activations times a bfloat16 / float16 weight widened in registers (the weight
stays 2 bytes a value in memory). Oracle: linear_w16_ref, F.linear on the weight converted to float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

W16_DTYPES = (torch.bfloat16, torch.float16)


def check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.dtype == torch.float32, f"x [rows, in] float32, got {x.dtype} {tuple(x.shape)}"
    assert w.dim() == 2 and w.dtype in W16_DTYPES and w.shape[1] == x.shape[1], \
        f"w [out, in={x.shape[1]}] bfloat16/float16, got {w.dtype} {tuple(w.shape)}"
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (w.shape[0],)), "bias [out] float32"


def linear_w16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check(x, w, bias)
    return torch.ops.kvmesh_cpu.linear_w16(x.contiguous(), w.contiguous(), bias)


def linear_w16_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op's output for tracing (torch.compile of a step through WeightLinear): [rows, out] float32."""
    return x.new_empty((x.shape[0], w.shape[0]))


def linear_w16_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check(x, w, bias)
    return F.linear(x, w.float(), bias)
