"""Wrapper of rms_norm.cpp: RMSNorm and in-place residual-add + RMSNorm (oracle: kernels/rmsnorm.py's twins)."""
from __future__ import annotations

import torch

from kernels.rmsnorm import check_rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm(x, weight)
    assert x.is_contiguous() and weight.dtype == x.dtype, "contiguous rows, weight in x's dtype"
    return torch.ops.kvmesh_cpu.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual); returns (x, residual)."""
    check_rms_norm(x, weight)
    assert x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype, "x, residual, weight must match"
    assert x.is_contiguous() and residual.is_contiguous(), "add_rms_norm works in place on contiguous tensors"
    torch.ops.kvmesh_cpu.add_rms_norm(x, residual, weight, eps)
    return x, residual
