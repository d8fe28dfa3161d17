"""One rank's view of its tensor-parallel group: its rank, the degree, and the torch.distributed process group
its collectives run on (gloo on CPU, NCCL on CUDA). The model layers call only the two collectives below."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def __post_init__(self) -> None:
        assert self.size >= 1 and 0 <= self.rank < self.size, f"rank {self.rank} of {self.size}"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the row-parallel layers' partial products)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """x of every rank concatenated along the last dim on rank 0 (None on the others): the output head's
        logits go only where the sampler is."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                    group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None
