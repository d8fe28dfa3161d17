"""How many KV blocks a worker may allocate on its GPU, vLLM's way.

The worker's budget is `gpu_memory_utilization` x the device's *total* memory, so two workers on one
GPU can split it (0.45 + 0.45) instead of the first one taking most of what is free. From the budget
come off: the weights, the peak of a profiling forward at max_num_batched_tokens (activations, logits,
the sampler's working set) in the allocator's reserved bytes (`step_peak`), the memory this process holds
outside torch's allocator (CUDA context, cuBLAS workspaces) and a reserve for CUDA graphs. What remains is the
KV pool. The arithmetic is pure functions (`step_peak`, `plan_kv_pool`), tested with numbers;
shared/engine/kv_pool_size.py fills them in on a real device.
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
    peak_activation_bytes: int  # the profiled step's reserved peak above the weights (step_peak)
    non_torch_bytes: int  # this process's memory outside torch's allocator, grown since start
    graph_reserve_bytes: int


@dataclass(frozen=True)
class KVPoolPlan:
    budget_bytes: int
    kv_bytes: int
    num_blocks: int

    def describe(self, p: MemoryProfile) -> str:
        return (f"budget {_gib(self.budget_bytes)} = weights {_gib(p.weights_bytes)} + step peak (reserved) "
                f"{_gib(p.peak_activation_bytes)} + non-torch {_gib(p.non_torch_bytes)} + graphs "
                f"{_gib(p.graph_reserve_bytes)} + KV {_gib(self.kv_bytes)} ({self.num_blocks} blocks)")


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def step_peak(allocated_before: int, temp_cache_bytes: int, peak_allocated: int, peak_reserved: int) -> int:
    """The profiled step's term in the budget: the allocator's *reserved* peak during the step, above what was
    allocated before it (the weights, counted on their own) and less the temporary KV cache it ran on (the real
    pool, counted on its own, replaces it).

    Reserved, not allocated: a worker is held to its budget by what the allocator holds from the device
    (torch.cuda.max_memory_reserved), and that exceeds the allocated peak by the allocator's slack: sizes rounded
    up to its blocks and segments, segments split and partly free. A pool sized from the allocated peak leaves
    the reserved peak above the budget by that slack. Counted this way the term also holds the weights' own
    rounding and the temporary cache's segment rounding, which stands in for the real pool's (the same number of
    tensors, each rounded up the same way)."""
    return max(max(peak_allocated, peak_reserved) - allocated_before - temp_cache_bytes, 0)


def plan_kv_pool(p: MemoryProfile, utilization: float, bytes_per_block: int, min_blocks: int) -> KVPoolPlan:
    """The KV pool that fits the budget, or MemoryBudgetError saying what does not fit and what to change.

    The rule: budget = utilization x total memory = weights + the step's reserved peak (step_peak) + non-torch
    memory + the graphs' reserve + the KV pool, so the worker's reserved peak (weights, pool, graphs and a
    step's working set, all through the allocator) plus its memory outside torch stays within the budget."""
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
