"""The paged KV pool: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim];
sizing it, allocating it, and copying whole blocks out of it and into it."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from kernels.fp8_bytes import indexable
from shared.block_hash import BlockHash, root_hash
from shared.config import EngineConfig
from shared.engine.errors import MemoryBudgetError
from shared.engine.kv_placeholder import PLACEHOLDER_MESSAGE, is_placeholder
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


# The pool: per layer K and V [num_blocks, block_size, kv_heads, head_dim]. KV that leaves it is a
# KVBlocks (shared/kv_blocks.py).
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def gather_blocks(caches: KVCaches, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of physical blocks, [layers, n, block_size, kv_heads, head_dim] each, on the cache's device."""
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=caches[0][0].device)
    # Gathered straight into one tensor per K and V (not gathered per layer, then stacked: a second
    # copy of every byte; 2.5 against 4.5 ms for a 2,048-token prompt's 33.6 MB on the CPU machine).
    k = caches[0][0].new_empty((len(caches), len(ids), *caches[0][0].shape[1:]))
    v = torch.empty_like(k)
    for i, (kc, vc) in enumerate(caches):  # FP8 as bytes (kernels/fp8_bytes.py): the views write into k and v
        torch.index_select(indexable(kc), 0, ids, out=indexable(k[i]))
        torch.index_select(indexable(vc), 0, ids, out=indexable(v[i]))
    return k, v


def write_blocks(caches: KVCaches, block_ids: Seq[int], k: torch.Tensor, v: torch.Tensor, first_layer: int = 0) -> None:
    """Write K/V ([layers, n, block_size, kv_heads, head_dim], layers from first_layer on) into physical blocks."""
    if is_placeholder(k) or is_placeholder(v):  # before any shape check: say what it is
        raise ValueError(PLACEHOLDER_MESSAGE)
    n = k.shape[1]
    ids = torch.tensor(list(block_ids), device=caches[0][0].device)
    layers = caches[first_layer : first_layer + k.shape[0]]
    expected = (len(layers), n, *caches[0][0].shape[1:])
    if not layers or tuple(k.shape) != expected or tuple(v.shape) != expected:
        raise ValueError(f"KV blocks shaped {tuple(k.shape)}/{tuple(v.shape)} from layer {first_layer}, "
                         f"expected {expected}")
    cache_dtype = caches[0][0].dtype
    if k.dtype != cache_dtype and torch.float8_e4m3fn in (k.dtype, cache_dtype):
        # Converting to or from FP8 here would drop the scales; the hash root keeps the kvstore from
        # mixing them, and a prefill worker must run the same --kv-cache-dtype as its decode workers.
        raise ValueError(f"KV blocks in {k.dtype} cannot be written into a {cache_dtype} cache")
    for i, (kc, vc) in enumerate(layers):
        _copy_blocks(kc, ids, k[i])
        _copy_blocks(vc, ids, v[i])


def _copy_blocks(cache: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    # FP8 as bytes (kernels/fp8_bytes.py); write_blocks refused a conversion to or from FP8 before this.
    indexable(cache).index_copy_(0, ids, indexable(src.to(cache.device, cache.dtype)))


def engine_root(c: EngineConfig, kv: torch.dtype) -> BlockHash:
    """The root of every block hash of an engine with config c and KV dtype kv. The KV dtype is in it so FP8
    and model-dtype blocks never share a hash (or a kvstore entry); quantized weights compute different KV
    from the same dtype, so their blocks hash apart too."""
    model_id = c.model_id or Path(c.model).resolve().name
    kv_kind = str(kv).removeprefix("torch.") + (f"/weights-{c.quantization}" if c.quantization else "")
    return root_hash(model_id, c.block_size, kv_kind, c.cache_salt)
