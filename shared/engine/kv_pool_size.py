"""How many KV blocks an engine's pool gets: an explicit count, else an explicit byte budget (or CPU's
default), else what the GPU memory budget leaves after the weights and a profiled worst-case step."""
from __future__ import annotations

import logging

import torch

from shared.config import EngineConfig
from shared.engine.kv_cache import bytes_per_block, num_blocks_for
from shared.engine.memory_budget import CUDA_GRAPH_RESERVE, DeviceSnapshot, MemoryProfile, plan_kv_pool, snapshot
from shared.engine.model_runner import ModelRunner
from shared.engine.profile_run import profile_run
from shared.engine.sampler import Sampler

log = logging.getLogger(__name__)


def plan_num_blocks(c: EngineConfig, runner: ModelRunner, sampler: Sampler, kv_dtype: torch.dtype,
                    max_model_len: int, start: DeviceSnapshot | None) -> int:
    """start: the device as it was before the weights loaded (None off CUDA)."""
    mc = runner.model.cfg
    if c.num_kv_blocks:
        return c.num_kv_blocks
    if start is None or c.kv_cache_bytes is not None:
        return num_blocks_for(mc, c.block_size, kv_dtype, c.kv_cache_bytes)
    device = torch.device(c.device)
    weights = torch.cuda.memory_allocated(device)
    peak = profile_run(runner, sampler, kv_dtype, c.max_num_batched_tokens, c.max_num_seqs, max_model_len)
    now = snapshot(c.device)
    # Growth of device memory in use that torch's allocator does not account for (cuBLAS, NCCL, ...).
    non_torch = max(start.free_bytes - now.free_bytes - torch.cuda.memory_reserved(device), 0)
    profile = MemoryProfile(start.total_bytes, start.free_bytes, weights, peak, non_torch,
                            0 if c.enforce_eager else CUDA_GRAPH_RESERVE)
    plan = plan_kv_pool(profile, c.gpu_memory_utilization, bytes_per_block(mc, c.block_size, kv_dtype),
                        -(-max_model_len // c.block_size))
    log.info("memory: %s", plan.describe(profile))
    return plan.num_blocks
