"""Wrapper of silu_mul.cpp (oracle: kernels/silu_mul.py's silu_mul_ref)."""
from __future__ import annotations

import torch

from kernels.silu_mul import check_silu_mul


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    check_silu_mul(x)
    return torch.ops.kvmesh_cpu.silu_mul(x if x.is_contiguous() else x.contiguous())
