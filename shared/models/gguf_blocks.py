"""GGUF Q4_0 / Q4_1 blocks kept as they are stored, so a CPU worker can serve them without dequantizing.

A Q4_0 / Q4_1 block is 32 weights of one row: 4-bit codes q in [0, 15] and fp16 scalars, w = (q - 8) * d (Q4_0)
or w = q * d + m (Q4_1). The conversion (shared/models/gguf_convert.py) writes, beside the dequantized float32
checkpoint, one more safetensors file with each such tensor's codes (two per byte: column 2i in the low nibble,
2i + 1 in the high one), d and m (Q4_0: m = -8 d, exact in float32 but not in fp16, so it is stored as float32 for
both types) under its Hugging Face name, and every tensor's GGUF type in the file's metadata.
shared/models/gguf_quant.py turns them into torch's int4 CPU layout. numpy only, like the conversion.
"""
from __future__ import annotations

import json

import numpy as np

BLOCKS_FILE = "gguf_blocks.safetensors"
BLOCK = 32
NATIVE_Q4 = ("Q4_0", "Q4_1")
_HEADER_BYTES = {"Q4_0": 2, "Q4_1": 4}  # d (fp16), then m (fp16) for Q4_1, then 16 bytes of codes


def q4_blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw: a GGUF reader's [rows, bytes per row] uint8 data of a Q4_0/Q4_1 tensor -> (codes [rows, k / 2] uint8
    pairs, d [rows, k / 32] float32, m [rows, k / 32] float32) with w[r, c] = q[r, c] * d + m per 32 columns."""
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


def blocks_metadata(types: dict[str, str]) -> dict[str, str]:
    return {"format": "kvmesh-gguf-blocks", "gguf_types": json.dumps(types, sort_keys=True)}


def dequantize_q4(pairs: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """What the blocks mean, in float32 (gguf's own dequantization computes d * q + m the same way)."""
    codes = np.stack([pairs & 0x0F, pairs >> 4], axis=-1).reshape(pairs.shape[0], -1).astype(np.float32)
    rows, k = codes.shape
    return (d[..., None] * codes.reshape(rows, k // BLOCK, BLOCK) + m[..., None]).reshape(rows, k)
