"""The 4-bit weight layout (AWQ and GPTQ checkpoints, repacked at load by shared/models/w4a16.py) that the W4A16
kernels read, its checks, and its definition as a torch dequantization:
- qweight int32 [K / 8, N]: eight 4-bit values of one output column along K, value b of word r is row 8r + b
  (GPTQ's own packing, so a warp reading a row of words reads N consecutive columns);
- scales [groups, N] (the checkpoint's float16 values, unrounded) and zeros uint8 [groups, N]:
  w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with g = k // GROUP, or g = g_idx[k] when the rows' groups are
  not contiguous runs (GPTQ's act-order checkpoints on a tensor-parallel rank);
- the dequantization is done in float32 (exact: a 4-bit integer times a float16 fits float32's mantissa), then
  rounded once to the activations' dtype.
"""
from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32 word
BLOCK_K = 32  # divides every supported group size
SUPPORTED_GROUPS = (32, 64, 128)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K / 8, N] -> int32 [K, N] of values in [0, 15] (value b of word r is row 8r + b)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    vals = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF
    return vals.reshape(-1, qweight.shape[1])


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] of values in [0, 15] -> int32 [K / 8, N] (the inverse of unpack_rows)."""
    k, n = q.shape
    assert k % PACK == 0, f"{k} rows are not a multiple of {PACK}"
    v = q.to(torch.int64).view(k // PACK, PACK, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    word = (v << shifts[None, :, None]).sum(dim=1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def row_groups(k: int, group: int, g_idx: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor:
    return g_idx.long() if g_idx is not None else torch.arange(k, device=device) // group


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                     g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [K, N]: what the kernel multiplies by (before the one rounding to the activations' dtype)."""
    q = unpack_rows(qweight)
    g = row_groups(q.shape[0], group, g_idx, q.device)
    return (q - zeros[g].to(torch.int32)).float() * scales[g].float()


def check_w4a16_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                       g_idx: torch.Tensor | None) -> None:
    assert qweight.dtype == torch.int32 and qweight.dim() == 2, f"qweight must be int32 [K / 8, N], got {qweight.dtype}"
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    assert zeros.dtype == torch.uint8 and zeros.shape == scales.shape and scales.shape[1] == n, \
        f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} ({zeros.dtype}) do not fit N = {n}"
    if g_idx is None:
        assert group in SUPPORTED_GROUPS and k % group == 0 and scales.shape[0] == k // group, \
            f"group {group}: K = {k} in {scales.shape[0]} groups"
    else:
        assert g_idx.shape == (k,) and g_idx.dtype == torch.int32, "g_idx must be int32 [K]"
    assert k % BLOCK_K == 0, f"K = {k} is not a multiple of {BLOCK_K}"
