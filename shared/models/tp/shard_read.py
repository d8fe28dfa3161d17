"""Reading one rank's slice of a checkpoint tensor straight from its safetensors file (safe_open's get_slice
reads only those bytes): no rank materialises a whole weight of a split layer."""
from __future__ import annotations

import torch

from shared.models.tp.degree import TPShard


def read_shard(f, name: str, split: str | None, shape: tuple[int, ...], shard: TPShard) -> torch.Tensor:  # noqa: ANN001 - a safe_open handle
    """Rank `shard.rank`'s part of tensor `name` (whole shape `shape`): rows or columns split evenly, the
    vocabulary in ranges of shard.vocab_per_rank (the last one may be short or empty), the rows of the rank's KV
    heads (shared by shard.kv_replicas ranks when there are fewer KV heads than ranks), or all of it."""
    if split is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    r = shard.rank
    if split == "vocab":
        start = min(shard.vocab_start, shape[0])
        return sl[start : min(start + shard.vocab_per_rank, shape[0])]
    if split == "rows":
        n = shape[0] // shard.size
        return sl[r * n : (r + 1) * n]
    if split == "kv_heads":
        start = shard.kv_head_start * shard.head_dim
        return sl[start : start + shard.kv_size]
    if split == "cols":
        n = shape[1] // shard.size
        return sl[:, r * n : (r + 1) * n]
    raise ValueError(f"unknown split {split!r}")
