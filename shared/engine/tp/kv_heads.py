"""KV blocks between one rank's head shard and whole blocks: each rank's cache holds its KV heads of every
block (a range of them, or, with fewer KV heads than ranks, the one head its query heads use, held by
`replicas` ranks in a row), and what leaves or enters the engine (tiers, prefill pushes, the kvstore) is always
whole blocks with all heads, each head once, so any TP degree reads what any other wrote."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kernels.fp8_bytes import indexable  # the collectives carry an FP8 cache's bytes (gloo has no float8)

HEAD_DIM_AXIS = 3  # [layers, blocks, block_size, kv_heads, head_dim]


def gather_heads(local: torch.Tensor, size: int, rank: int, group: Any, replicas: int = 1) -> torch.Tensor | None:
    """Every KV head's blocks, concatenated by heads on rank 0 (None elsewhere). Replicated heads are taken once,
    from the first rank that holds each (ranks 0, replicas, 2 * replicas, ...); the other replicas send nothing."""
    local = local.contiguous()
    wire = indexable(local)
    if replicas == 1:
        parts = [torch.empty_like(wire) for _ in range(size)] if rank == 0 else None
        dist.gather(wire, parts, dst=0, group=group)
    elif rank == 0:
        parts = [wire]
        for src in range(replicas, size, replicas):
            parts.append(torch.empty_like(wire))
            dist.recv(parts[-1], src=src, group=group)
    else:
        parts = None
        if rank % replicas == 0:
            dist.send(wire, dst=0, group=group)
    return torch.cat(parts, dim=HEAD_DIM_AXIS).view(local.dtype) if parts is not None else None


def scatter_heads(whole: torch.Tensor | None, out: torch.Tensor, size: int, rank: int, group: Any,
                  replicas: int = 1) -> torch.Tensor:
    """Rank 0's whole blocks cut by heads, rank r's share into `out` (shaped like one share, on the device): a
    replicated head goes to every rank that holds it."""
    parts = None
    if rank == 0:
        shares = [indexable(p.contiguous()) for p in whole.chunk(size // replicas, dim=HEAD_DIM_AXIS)]
        parts = [shares[r // replicas] for r in range(size)]
    dist.scatter(indexable(out), parts, src=0, group=group)
    return out
