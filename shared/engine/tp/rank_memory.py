"""Each rank's memory profile, so a tensor-parallel worker's KV pool is planned per rank: every rank holds its own
weights shard, KV shard, activations and (on CUDA) NCCL buffers on its own GPU, which another worker may share,
so the pool is what the neediest rank can hold (the smallest plan over the ranks: block tables are the same on
every rank).

Rank 0 measures itself as a single-device engine does (shared/engine/kv_pool_size.py); followers measure the same
quantities around the same profiling step (PROFILE_KV swaps a temporary cache in and out on every rank, the step
itself is broadcast) and report them as int64s (MEMORY). Off CUDA every figure is 0 (no allocator counters)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.memory_budget import DeviceSnapshot, MemoryProfile, snapshot, step_peak

FIELDS = 5  # total, free at start, weights, peak activations, non-torch


@dataclass
class RankMemory:
    """A follower's counters: the device before its weights loaded, then what the profiling step used."""

    device: str
    start: DeviceSnapshot | None = None
    weights: int = 0
    before: int = 0  # allocated when the temporary cache came in (weights and what else lives on)
    temp_cache: int = 0
    peak: int = 0  # the step's reserved peak above before + the temporary cache (step_peak)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @staticmethod
    def at_start(device: str) -> RankMemory:
        return RankMemory(device, snapshot(device) if device.startswith("cuda") else None)

    def loaded(self) -> None:
        if self.on_cuda:
            self.weights = torch.cuda.memory_allocated(torch.device(self.device))

    def profile_started(self, temp_cache_bytes: int, before: int) -> None:
        self.before, self.temp_cache = before, temp_cache_bytes
        if self.on_cuda:
            torch.cuda.empty_cache()  # as profile_run.CudaMemory: the reserved peak counts what the step holds
            torch.cuda.reset_peak_memory_stats(torch.device(self.device))

    def profile_ended(self) -> None:
        if self.on_cuda:
            dev = torch.device(self.device)
            torch.cuda.synchronize(dev)
            self.peak = step_peak(self.before, self.temp_cache, torch.cuda.max_memory_allocated(dev),
                                  torch.cuda.max_memory_reserved(dev))
            torch.cuda.empty_cache()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(torch.device(self.device)) if self.on_cuda else 0

    def report(self) -> torch.Tensor:
        """[total, free at start, weights, peak activations, non-torch] as int64 (zeros off CUDA)."""
        if not self.on_cuda or self.start is None:
            return torch.zeros(FIELDS, dtype=torch.int64)
        dev = torch.device(self.device)
        now = snapshot(self.device)
        non_torch = max(self.start.free_bytes - now.free_bytes - torch.cuda.memory_reserved(dev), 0)
        return torch.tensor([self.start.total_bytes, self.start.free_bytes, self.weights, self.peak, non_torch],
                            dtype=torch.int64)


def profile_of(report: list[int], graph_reserve: int) -> MemoryProfile:
    return MemoryProfile(report[0], report[1], report[2], report[3], report[4], graph_reserve)
