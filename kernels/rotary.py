"""Rotary position embedding applied in place to q and k (rotate-half convention of the HF Llama family).

The scaling type (default, linear, llama3) lives in the cos/sin table (shared/models/rope.py builds it);
the kernel only gathers the table at each token's position.
"""
from __future__ import annotations

import torch


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Torch twin. q [tokens, heads, head_dim], k [tokens, kv_heads, head_dim], positions [tokens],
    cos_sin_cache [max_positions, head_dim] float32 (cos in the first half, sin in the second)."""
    cos_sin = cos_sin_cache[positions]
    half = q.shape[-1] // 2
    for x in (q, k):
        cos, sin = cos_sin[:, None, :half].to(x.dtype), cos_sin[:, None, half:].to(x.dtype)
        x1, x2 = x[..., :half].clone(), x[..., half:].clone()
        x[..., :half] = x1 * cos - x2 * sin
        x[..., half:] = x2 * cos + x1 * sin


def check_rotary(q, k, positions, cos_sin_cache) -> None:
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], \
        f"q {tuple(q.shape)} / k {tuple(k.shape)} must be [tokens, heads, head_dim]"
    assert positions.shape == (q.shape[0],), f"positions must be [{q.shape[0]}]"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == q.shape[2], "cos_sin_cache must be [P, head_dim]"


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    check_rotary(q, k, positions, cos_sin_cache)
    rotary_ref(q, k, positions, cos_sin_cache)
