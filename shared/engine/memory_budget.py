"""How many KV blocks a worker may allocate on its GPU, vLLM's way.

The worker's budget is `gpu_memory_utilization` x the device's *total* memory, so two workers on one
GPU can split it (0.45 + 0.45) instead of the first one taking most of what is free. From the budget
come off: the weights, the peak of a profiling forward at max_num_batched_tokens (activations, logits,
the sampler's working set), the memory this process holds outside torch's allocator (CUDA context,
cuBLAS workspaces) and a reserve for CUDA graphs. What remains is the KV pool. The arithmetic is a pure
function (`plan_kv_pool`), tested with numbers; `measure` fills it in on a real device.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.errors import MemoryBudgetError

GIB = 1 << 30
# CUDA graphs of the decode buckets share one memory pool whose size is about the largest bucket's
# activations, already covered by the profile; this covers the graphs' own bookkeeping. Speculative decoding's
# verify graphs and a draft model's decode graphs (same pool) add their estimate: kv_pool_size.graph_reserve.
CUDA_GRAPH_RESERVE = 256 << 20


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int  # the device's total memory
    free_at_start: int  # free when this worker started (other processes hold the rest)
    weights_bytes: int
    peak_activation_bytes: int  # profiled peak above the weights
    non_torch_bytes: int  # this process's memory outside torch's allocator, grown since start
    graph_reserve_bytes: int


@dataclass(frozen=True)
class KVPoolPlan:
    budget_bytes: int
    kv_bytes: int
    num_blocks: int

    def describe(self, p: MemoryProfile) -> str:
        return (f"budget {_gib(self.budget_bytes)} = weights {_gib(p.weights_bytes)} + activations "
                f"{_gib(p.peak_activation_bytes)} + non-torch {_gib(p.non_torch_bytes)} + graphs "
                f"{_gib(p.graph_reserve_bytes)} + KV {_gib(self.kv_bytes)} ({self.num_blocks} blocks)")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def plan_kv_pool(p: MemoryProfile, utilization: float, bytes_per_block: int, min_blocks: int) -> KVPoolPlan:
    """The KV pool that fits the budget, or MemoryBudgetError saying what does not fit and what to change."""
    budget = int(p.total_bytes * utilization)
    # The budget must have been free when this worker started (its own CUDA context excepted):
    # otherwise another process holds part of it and the pool would run out at the first long prompt.
    if budget > p.free_at_start:
        raise MemoryBudgetError(
            f"--gpu-memory-utilization {utilization} asks for {_gib(budget)} of the device's {_gib(p.total_bytes)}, "
            f"but only {_gib(p.free_at_start)} was free at start (other processes hold the rest); lower "
            f"--gpu-memory-utilization to at most {p.free_at_start / p.total_bytes:.2f} or free the device")
    kv_bytes = budget - p.weights_bytes - p.peak_activation_bytes - p.non_torch_bytes - p.graph_reserve_bytes
    num_blocks = max(kv_bytes, 0) // bytes_per_block
    plan = KVPoolPlan(budget, max(kv_bytes, 0), num_blocks)
    if num_blocks < min_blocks:
        need = (p.weights_bytes + p.peak_activation_bytes + p.non_torch_bytes + p.graph_reserve_bytes
                + min_blocks * bytes_per_block)
        raise MemoryBudgetError(
            f"the memory budget cannot hold one full-length request ({min_blocks} KV blocks of "
            f"{bytes_per_block} bytes): {plan.describe(p)}; needs {_gib(need)}, i.e. --gpu-memory-utilization "
            f">= {need / p.total_bytes:.2f}, or lower --max-model-len / --max-num-batched-tokens, or use "
            f"--kv-cache-dtype fp8")
    return plan


@dataclass(frozen=True)
class DeviceSnapshot:
    free_bytes: int
    total_bytes: int


def snapshot(device: str) -> DeviceSnapshot:
    """Free/total memory now. The first call creates this process's CUDA context, so take it before loading."""
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceSnapshot(free, total)
