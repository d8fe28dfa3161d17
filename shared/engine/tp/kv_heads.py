"""KV blocks between one rank's head shard and whole blocks: each rank's cache holds KV heads
[rank * h, (rank + 1) * h) of every block, and what leaves or enters the engine (tiers, prefill pushes, the
kvstore) is always whole blocks with all heads, so any TP degree reads what any other wrote."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

HEAD_DIM_AXIS = 3  # [layers, blocks, block_size, kv_heads, head_dim]


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor as the collectives carry it: an FP8 cache's bytes as uint8 (gloo has no float8 types)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def gather_heads(local: torch.Tensor, size: int, rank: int, group: Any) -> torch.Tensor | None:
    """Every rank's head shard of the same blocks, concatenated by heads on rank 0 (None elsewhere)."""
    local = local.contiguous()
    wire = _wire(local)
    parts = [torch.empty_like(wire) for _ in range(size)] if rank == 0 else None
    dist.gather(wire, parts, dst=0, group=group)
    return torch.cat(parts, dim=HEAD_DIM_AXIS).view(local.dtype) if parts is not None else None


def scatter_heads(whole: torch.Tensor | None, out: torch.Tensor, size: int, rank: int, group: Any) -> torch.Tensor:
    """Rank 0's whole blocks cut by heads, rank r's share into `out` (shaped like one share, on the device)."""
    parts = [_wire(p.contiguous()) for p in whole.chunk(size, dim=HEAD_DIM_AXIS)] if rank == 0 else None
    dist.scatter(_wire(out), parts, src=0, group=group)
    return out
