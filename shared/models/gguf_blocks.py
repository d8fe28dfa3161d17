"""GGUF Q4_0 / Q4_1 / Q4_K blocks kept as they are stored, so a CPU worker can serve them without dequantizing.

A Q4_0 / Q4_1 block is 32 weights of one row: 4-bit codes q in [0, 15] and fp16 scalars, w = (q - 8) * d (Q4_0)
or w = q * d + m (Q4_1). A Q4_K super-block of 256 weights is eight such blocks whose d and m are an fp16 scale
times a 6-bit integer each (w = q * d * scale_j - dmin * min_j): the same form, with d and m exact in float32.
The conversion (shared/models/gguf_convert.py) writes, beside the dequantized float32 checkpoint, one more
safetensors file with each such tensor's codes (two per byte: column 2i in the low nibble, 2i + 1 in the high
one), d and m (float32: Q4_0's m = -8 d and Q4_K's products are exact in float32 but not in fp16) under its
Hugging Face name, and every tensor's GGUF type in the file's metadata.
shared/models/gguf_quant.py turns them into torch's int4 CPU layout. numpy only, like the conversion.
"""
from __future__ import annotations

import json

import numpy as np

BLOCKS_FILE = "gguf_blocks.safetensors"
BLOCK = 32
NATIVE_Q4 = ("Q4_0", "Q4_1", "Q4_K")
_HEADER_BYTES = {"Q4_0": 2, "Q4_1": 4}  # d (fp16), then m (fp16) for Q4_1, then 16 bytes of codes
# Q4_K super-block: d, dmin (fp16), 12 bytes of eight 6-bit scales and mins, 128 bytes of codes for 256 weights.
_QK_K, _Q4_K_BYTES = 256, 144
_Q6_K_BYTES = 210
NATIVE_Q8 = ("Q6_K",)  # int8 codes with a scale per 16 (gguf_blocks: q6_k_blocks)


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K tensor as codes [rows, k] in column order and d, m [rows, k / 32]: sub-block j of a super-block is
    w = q * (d * scale_j) - dmin * min_j, so d_j = d * scale_j and m_j = -(dmin * min_j), both exact in float32
    (an fp16 times a 6-bit integer), which is how gguf's dequantizer computes them too."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, _Q4_K_BYTES)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    lo, hi, mix = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    scales = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mins = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)  # 32 bytes hold sub-blocks 2c (low nibbles) and 2c + 1 (high)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(rows, -1)
    return codes, (d[..., None] * scales).reshape(rows, -1), (-(dmin[..., None] * mins)).reshape(rows, -1)


def q4_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw: a GGUF reader's [rows, bytes per row] uint8 data of a Q4_0/Q4_1/Q4_K tensor -> (codes [rows, k / 2]
    uint8 pairs, d [rows, k / 32] float32, m [rows, k / 32] float32) with w[r, c] = q[r, c] * d + m per 32
    columns."""
    if type_name == "Q4_K":
        codes, d, m = _q4_k(raw)
    else:
        head = _HEADER_BYTES[type_name]
        rows = raw.shape[0]
        blocks = raw.reshape(rows, -1, head + BLOCK // 2)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        if type_name == "Q4_1":
            m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        else:
            m = -8 * d
        qs = blocks[..., head:]  # [rows, nb, 16]: byte j holds weight j (low nibble) and weight j + 16 (high)
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)  # [rows, k] in column order
    pairs = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(pairs), d, m


def q6_k_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw: a GGUF reader's [rows, bytes per row] uint8 data of a Q6_K tensor -> (codes [rows, k] int8 in [-32, 31],
    d [rows, k / 16] float32) with w[r, c] = q[r, c] * d per 16 columns. A super-block of 256 is 128 bytes of low
    nibbles, 64 of 2-bit highs, 16 int8 scales, then an fp16 d; d * scale is exact in float32 (fp16 times int8),
    as gguf's dequantizer computes it too."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, _Q6_K_BYTES)
    ql, qh = b[..., :128], b[..., 128:192]
    scales = b[..., 192:208].view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    # Per half of 128: low nibbles of ql[0:32], ql[32:64], then high nibbles of both, each with 2 bits of qh.
    codes = (low.reshape(rows, -1, 2, 4, 32) | (high.reshape(rows, -1, 2, 4, 32) << 4)).astype(np.int8) - 32
    return np.ascontiguousarray(codes.reshape(rows, -1)), (d[..., None] * scales).reshape(rows, -1)


def blocks_metadata(types: dict[str, str]) -> dict[str, str]:
    return {"format": "kvmesh-gguf-blocks", "gguf_types": json.dumps(types, sort_keys=True)}


def dequantize_q4(pairs: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What the blocks mean, in float32 (gguf's own dequantization computes d * q + m the same way)."""
    codes = np.stack([pairs & 0x0F, pairs >> 4], axis=-1).reshape(pairs.shape[0], -1).astype(np.float32)
    rows, k = codes.shape
    return (d[..., None] * codes.reshape(rows, k // BLOCK, BLOCK) + m[..., None]).reshape(rows, k)
