"""The paged KV pool: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch

from shared.engine.errors import MemoryBudgetError
from shared.models.model_config import ModelConfig

DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.kv_size * torch.tensor([], dtype=dtype).element_size()


def kv_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The cache's element type: the model's, or FP8 e4m3 (dequantized on load by the attention kernels)."""
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_bytes: int | None) -> int:
    """Blocks in a byte budget (the CPU default, or an explicit --kv-cache-bytes on any device)."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    if kv_cache_bytes is None:
        kv_cache_bytes = DEFAULT_CPU_KV_BYTES
    n = kv_cache_bytes // per_block
    if n < 1:
        raise MemoryBudgetError(f"a KV budget of {kv_cache_bytes} bytes is smaller than one block ({per_block} bytes); "
                                f"raise --kv-cache-bytes")
    return n


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]
