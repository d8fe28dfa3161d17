"""Wrapper of gemv_dpbf16.cpp: bfloat16 activations times a bfloat16 weight with AVX512-BF16's vdpbf16ps, on the
kernels' own threads, for CPUs with native bf16 (where it replaces oneDNN's matmul: measured faster at every step
size from 1 to 128 rows at SmolLM2's shapes on a 2-core Zen 5, and its loop is shared out chunk by chunk, so it
does not stall when another process takes a core).

The weight is repacked once (pack_dpbf16) into blocks of 32 output rows: for each pair of input columns, the
block's 32 pairs side by side (64 values, one stream), so one instruction adds a pair of products into each of 16
outputs with the activations' pair broadcast. Oracle: linear_dpbf16_ref (unpack, a float32 matmul, rounded to
bf16 once); the sums differ only in float32 summation order (and vdpbf16ps flushes denormals).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

OUT_BLOCK = 32  # output rows per block of the packed weight (gemv_dpbf16.cpp's kOut)


def built() -> bool:
    """The loaded extension was compiled with AVX512-BF16 (this CPU's flags)."""
    return bool(torch.ops.kvmesh_cpu.dpbf16_built())


def pack_dpbf16(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] (in even) -> bf16 [ceil(out / 32), 32 * in]: block g, pair kk, output o at 64 kk + 2 o (+1 for the
    pair's second column); output rows past out are zero."""
    n, k = w.shape
    assert k % 2 == 0, f"in features {k} must be even"
    g = (n + OUT_BLOCK - 1) // OUT_BLOCK
    padded = torch.zeros(g * OUT_BLOCK, k, dtype=torch.bfloat16)
    padded[:n] = w.detach()
    return padded.view(g, OUT_BLOCK, k // 2, 2).permute(0, 2, 1, 3).reshape(g, OUT_BLOCK * k).contiguous()


def unpack_dpbf16(wp: torch.Tensor, out_features: int) -> torch.Tensor:
    g, size = wp.shape
    k = size // OUT_BLOCK
    return wp.view(g, k // 2, OUT_BLOCK, 2).permute(0, 2, 1, 3).reshape(g * OUT_BLOCK, k)[:out_features]


def check(x: torch.Tensor, wp: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> None:
    assert x.dim() == 2 and x.dtype == torch.bfloat16, f"x [rows, in] bfloat16, got {x.dtype} {tuple(x.shape)}"
    k = x.shape[1]
    want = ((out_features + OUT_BLOCK - 1) // OUT_BLOCK, OUT_BLOCK * k)
    assert wp.dtype == torch.bfloat16 and tuple(wp.shape) == want, \
        f"packed weight {want} bfloat16 for in={k}, out={out_features}, got {wp.dtype} {tuple(wp.shape)}"
    assert bias is None or bias.shape == (out_features,), f"bias [{out_features}]"


def linear_dpbf16(x: torch.Tensor, wp: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    check(x, wp, out_features, bias)
    return torch.ops.kvmesh_cpu.linear_dpbf16(x.contiguous(), wp, out_features, bias)


def linear_dpbf16_fake(x: torch.Tensor, wp: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The op's output for tracing (torch.compile of a step through DpLinear): [rows, out] bfloat16."""
    return x.new_empty((x.shape[0], out_features))


def linear_dpbf16_ref(x: torch.Tensor, wp: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    check(x, wp, out_features, bias)
    w = unpack_dpbf16(wp, out_features).float()
    return F.linear(x.float(), w, None if bias is None else bias.float()).bfloat16()
