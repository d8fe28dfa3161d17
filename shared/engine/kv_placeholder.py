"""Placeholder KV: what a simulated engine (shared/engine/sim_engine.py) pushes instead of real K/V.

A simulated worker's transfers carry the right number of blocks so the receiving side's bookkeeping is
real, but not their contents: each block is block_size bytes of one layer, one head, one dimension, in
uint8. uint8 is the flag: no KV cache is ever uint8, it travels by name on every wire (WireTensor's
dtype, the direct channel's frame header), a real engine refuses it by that name (kv_cache.write_blocks),
and the direct channel's frames refuse it before that (their dtype table has no uint8).
"""
from __future__ import annotations

import torch

PLACEHOLDER_DTYPE = torch.uint8
PLACEHOLDER_MESSAGE = "placeholder KV from a simulated engine worker (--engine sim); a real engine refuses it"


def placeholder_kv(num_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of num_blocks placeholder blocks: [1, n, block_size, 1, 1] uint8 each."""
    k = torch.zeros((1, num_blocks, block_size, 1, 1), dtype=PLACEHOLDER_DTYPE)
    return k, k.clone()


def is_placeholder(t: torch.Tensor) -> bool:
    return t.dtype == PLACEHOLDER_DTYPE
