"""Wrapper of gemv_gguf.cpp: float32 (or bf16) activations times a weight kept in GGUF blocks of 32 (Q4_0 / Q4_1, and Q4_K's
sub-blocks, as one format, w = q d + m; Q8_0, w = q d; Q8_16, Q6_K's codes minus 32 with a scale per 16), in the
kernel's layout (pack_q4 / pack_q8 / pack_q8_16 build it from the file's blocks; pack_q4x / pack_q8x interleave the
rows of Q4 and Q8_0 in groups for the int8-activation kernels, one vector lane a row).

act: ACT_F32 multiplies the float32 activations by the weights widened in registers; ACT_Q8 first rounds each
activation row to int8 blocks of 32 (d_x = max |x| / 127, round half to even) and multiplies codes by integer dot
products. Steps of more rows (MAX_ROWS with float32 activations, MAX_ROWS_Q8 with int8 ones) multiply dequantized
float32 tiles of the weight (at::mm). Oracle: linear_gguf_ref (dequantize by the format's definition, the same activation rounding, a float32
matmul): the kernel differs from it only by float32 summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Q4, Q8_0, Q8_16 = 0, 1, 2  # fmt (Q8_16: int8 codes with a scale per 16, GGUF Q6_K's form)
Q4X, Q8X = 3, 4  # Q4 / Q8_0 with the rows interleaved in groups (pack_q4x, pack_q8x): int8 activations only
ACT_F32, ACT_Q8 = 0, 1
FORMATS = {"Q4_0": Q4, "Q4_1": Q4, "Q4_K": Q4, "Q8_0": Q8_0, "Q6_K": Q8_16}
BLOCK = 32
SUB = 16  # Q8_16's scale group
MAX_ROWS = 16  # gemv.h's kMaxRows
MAX_ROWS_Q8 = 32  # gemv_gguf.cpp's kMaxRowsQ8: int8 activations stay on the block kernels up to here


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] in 0..15 (column order), d / m [out, in / 32] -> (qs [out, in / 2] uint8 in GGUF's in-block
    order: byte j of a block holds value j low and j + 16 high; scales [out, in / 32, 2] (d, m), float16 when every
    one is exactly a float16 (Q4_0's and Q4_1's scales, which the file stores so: a step reads 20 bytes a block
    instead of 24), else float32 (Q4_K's, products of a float16 and a 6-bit scale))."""
    n, k = codes.shape
    assert k % BLOCK == 0 and d.shape == m.shape == (n, k // BLOCK)
    c = codes.to(torch.uint8).view(n, k // BLOCK, 2, 16)
    qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scales = torch.stack([d.float(), m.float()], dim=-1).contiguous()
    half = scales.half()
    return qs, half if torch.equal(half.float(), scales) else scales


def q4x_lanes() -> int:
    """The rows a Q4X or Q8X group interleaves in the loaded extension's build (16 with AVX512-VNNI, else 8)."""
    return int(torch.ops.kvmesh_cpu.gguf_q4x_lanes())


def _interleave(qs: torch.Tensor, scales: torch.Tensor, lanes: int, chunks: int, unpack: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each group of `lanes` interleaved (or, unpack, back): per block, `chunks` chunks of lanes x 4
    bytes (chunk c: bytes 4c .. 4c + 3 of each row's block), and the block's scales (per row: 2 for Q4, 1 for
    Q8_0) as [scales a row, lanes]. Same shapes as the plain layout."""
    n, row_bytes = qs.shape
    assert n % lanes == 0, f"{n} rows are not groups of {lanes}"
    g, nb = n // lanes, row_bytes // (4 * chunks)
    per = scales.numel() // (n * nb)
    if unpack:
        x = qs.view(g, nb, chunks, lanes, 4).permute(0, 3, 1, 2, 4)
        sx = scales.reshape(g, nb, per, lanes).permute(0, 3, 1, 2)
    else:
        x = qs.view(g, lanes, nb, chunks, 4).permute(0, 2, 3, 1, 4)
        sx = scales.reshape(g, lanes, nb, per).permute(0, 2, 3, 1)
    return x.reshape(qs.shape).contiguous(), sx.reshape(scales.shape).contiguous()


def pack_q4x(qs: torch.Tensor, scales: torch.Tensor, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q4's (qs, scales) with each group of `lanes` rows interleaved, same shapes: for group g and block b,
    4 chunks of lanes x 4 bytes (chunk c: bytes 4c .. 4c + 3 of each row's block), and the scales as [groups,
    blocks, 2, lanes] (the rows' d, then their m), so one vector lane accumulates one row."""
    return _interleave(qs, scales, lanes, 4)


def unpack_q4x(qs: torch.Tensor, scales: torch.Tensor, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _interleave(qs, scales, lanes, 4, unpack=True)


def pack_q8x(qs: torch.Tensor, scales: torch.Tensor, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8's (qs, scales) with each group of `lanes` rows interleaved, same shapes: for group g and block b,
    8 chunks of lanes x 4 codes (chunk c: codes 4c .. 4c + 3 of each row's block), the scales as [groups, blocks,
    lanes]."""
    return _interleave(qs, scales, lanes, 8)


def unpack_q8x(qs: torch.Tensor, scales: torch.Tensor, lanes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _interleave(qs, scales, lanes, 8, unpack=True)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in] int8 codes, d [out, in / 32] -> (qs int8 [out, in], scales float32 [out, in / 32])."""
    n, k = q.shape
    assert k % BLOCK == 0 and d.shape == (n, k // BLOCK) and q.dtype == torch.int8
    return q.contiguous(), d.float().contiguous()


def pack_q8_16(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in] int8 codes, d [out, in / 16] -> (qs int8 [out, in], scales float32 [out, in / 16])."""
    n, k = q.shape
    assert k % BLOCK == 0 and d.shape == (n, k // SUB) and q.dtype == torch.int8
    return q.contiguous(), d.float().contiguous()


def check(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: int,
          act: int) -> None:
    assert fmt in (Q4, Q8_0, Q8_16, Q4X, Q8X) and act in (ACT_F32, ACT_Q8), f"fmt {fmt}, act {act}"
    assert fmt not in (Q4X, Q8X) or act == ACT_Q8, "interleaved rows take int8 activations"
    assert x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16), \
        f"x [rows, in] float32 or bfloat16, got {x.dtype} {tuple(x.shape)}"
    k = x.shape[1]
    assert k % BLOCK == 0, f"in features {k} not a multiple of {BLOCK}"
    n = qs.shape[0]
    want = {Q4: (torch.uint8, (n, k // 2), (n, k // BLOCK, 2)), Q8_0: (torch.int8, (n, k), (n, k // BLOCK)),
            Q8_16: (torch.int8, (n, k), (n, k // SUB)), Q4X: (torch.uint8, (n, k // 2), (n, k // BLOCK, 2)),
            Q8X: (torch.int8, (n, k), (n, k // BLOCK))}[fmt]
    assert qs.dtype == want[0] and tuple(qs.shape) == want[1], f"qs {qs.dtype} {tuple(qs.shape)}, want {want[:2]}"
    dtypes = (torch.float32, torch.float16) if fmt in (Q4, Q4X) else (torch.float32,)
    assert scales.dtype in dtypes and tuple(scales.shape) == want[2], f"scales {scales.dtype} {tuple(scales.shape)}"
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (n,)), "bias [out] float32"


def linear_gguf(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: int,
                act: int) -> torch.Tensor:
    check(x, qs, scales, bias, fmt, act)
    return torch.ops.kvmesh_cpu.linear_gguf(x.contiguous(), qs, scales, bias, fmt, act)


def linear_gguf_fake(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: int,
                     act: int) -> torch.Tensor:
    """The op's output for tracing (torch.compile of a step through GgufLinear): [rows, out] in x's dtype."""
    return x.new_empty((x.shape[0], qs.shape[0]))


def dequantize_ref(qs: torch.Tensor, scales: torch.Tensor, fmt: int) -> torch.Tensor:
    """The weight [out, in] float32 the blocks stand for."""
    if fmt == Q4X:
        qs, scales = unpack_q4x(qs, scales, q4x_lanes())
        fmt = Q4
    elif fmt == Q8X:
        qs, scales = unpack_q8x(qs, scales, q4x_lanes())
        fmt = Q8_0
    n, scales = qs.shape[0], scales.float()
    if fmt == Q4:
        b = qs.view(n, -1, 16)
        codes = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # [out, blocks, 32]
        return (codes * scales[..., :1] + scales[..., 1:]).reshape(n, -1)
    group = BLOCK if fmt == Q8_0 else SUB
    return (qs.float().view(n, -1, group) * scales[..., None]).reshape(n, -1)


def quantize_act_ref(x: torch.Tensor) -> torch.Tensor:
    """x rounded through int8 blocks of 32, as ACT_Q8 multiplies it (float32)."""
    b = x.reshape(x.shape[0], -1, BLOCK)
    amax = b.abs().amax(dim=-1, keepdim=True)
    # A tensor over a tensor: torch computes `127.0 / amax` as 127 * (1 / amax), rounded twice (a code off by one
    # where x * inv lands near a half), not the one division the kernel does.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(b * inv) * (amax / 127.0)).reshape(x.shape)


def linear_gguf_ref(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, fmt: int,
                    act: int) -> torch.Tensor:
    check(x, qs, scales, bias, fmt, act)
    xf = x.float()
    xa = quantize_act_ref(xf) if act == ACT_Q8 and xf.shape[0] <= MAX_ROWS_Q8 else xf
    return F.linear(xa, dequantize_ref(qs, scales, fmt), bias).to(x.dtype)
