"""How many KV blocks an engine's pool gets: an explicit count, else an explicit byte budget (or CPU's
default), else what the GPU memory budget leaves after the weights and a profiled worst-case step."""
from __future__ import annotations

import logging

import torch

from shared.config import EngineConfig
from shared.engine.kv_cache import bytes_per_block, num_blocks_for
from shared.engine.errors import MemoryBudgetError
from shared.engine.memory_budget import (CUDA_GRAPH_RESERVE, GIB, DeviceSnapshot, MemoryProfile, plan_kv_pool,
                                         snapshot)
from shared.engine.tp.rank_memory import profile_of
from shared.engine.model_runner import ModelRunner
from shared.engine.profile_run import profile_draft, profile_run
from shared.engine.sampler import Sampler
from shared.engine.spec.draft_model import DraftModel
from shared.engine.verify_buckets import decode_graph_bytes, verify_plan_for

log = logging.getLogger(__name__)


def plan_num_blocks(c: EngineConfig, runner: ModelRunner, sampler: Sampler, kv_dtype: torch.dtype,
                    max_model_len: int, start: DeviceSnapshot | None, draft: DraftModel | None = None) -> int:
    """start: the device as it was before the weights loaded (None off CUDA). draft: a draft model (loaded: its
    weights are in the allocated bytes), whose largest forward is profiled beside the target's step."""
    mc = runner.model.cfg
    if c.num_kv_blocks:
        return c.num_kv_blocks
    if start is None or c.kv_cache_bytes is not None:
        return num_blocks_for(mc, c.block_size, kv_dtype, c.kv_cache_bytes)
    device = torch.device(c.device)
    weights = torch.cuda.memory_allocated(device)
    peak = profile_run(runner, sampler, kv_dtype, c.max_num_batched_tokens, c.max_num_seqs, max_model_len)
    if draft is not None:
        draft_peak = profile_draft(draft.runner, draft.kv_dtype, c.max_num_batched_tokens, c.max_num_seqs,
                                   max_model_len)
        log.info("memory profile: target step %.2f GiB, draft forward %.2f GiB", peak / GIB, draft_peak / GIB)
        peak = max(peak, draft_peak)
    now = snapshot(c.device)
    # Growth of device memory in use that torch's allocator does not account for (cuBLAS, NCCL, ...).
    non_torch = max(start.free_bytes - now.free_bytes - torch.cuda.memory_reserved(device), 0)
    graphs = 0 if c.enforce_eager else graph_reserve(c, runner, max_model_len, draft)
    profiles = [MemoryProfile(start.total_bytes, start.free_bytes, weights, peak, non_torch, graphs)]
    rank_memory = getattr(runner, "rank_memory", None)  # a tensor-parallel rank 0: the followers measured too
    if rank_memory is not None:
        profiles += [profile_of(report, graphs) for report in rank_memory()]
    # A rank's blocks hold its KV heads only (runner.model.cache_config): each rank's pool is planned on its own
    # GPU, and the worker's is the smallest (block tables are the same on every rank).
    return plan_rank_pools(profiles, c.gpu_memory_utilization,
                           bytes_per_block(runner.model.cache_config, c.block_size, kv_dtype),
                           -(-max_model_len // c.block_size))


def graph_reserve(c: EngineConfig, runner: ModelRunner, max_model_len: int, draft: DraftModel | None) -> int:
    """Device bytes CUDA graphs keep beyond the profiled peak: the decode graphs' flat reserve, plus the verify
    graphs' and a draft's decode graphs' estimates (shared/engine/verify_buckets.py) when speculating."""
    total = CUDA_GRAPH_RESERVE
    dtype_bytes = next(runner.model.parameters()).element_size()
    verify = verify_plan_for(c, max_model_len)
    if verify is not None and c.tensor_parallel_size == 1:
        total += verify.memory_bytes(runner.model.cfg.hidden_size, dtype_bytes)
    if draft is not None:
        total += decode_graph_bytes(c.max_num_seqs, draft.config.hidden_size, dtype_bytes)
    return total


def plan_rank_pools(profiles: list[MemoryProfile], utilization: float, bytes_per_block: int, min_blocks: int) -> int:
    """KV blocks every rank's budget holds: the plan of the neediest rank (MemoryBudgetError names the rank that
    cannot hold one full-length request); one profile for a single-device engine."""
    plans = []
    for rank, profile in enumerate(profiles):
        try:
            plans.append(plan_kv_pool(profile, utilization, bytes_per_block, min_blocks))
        except MemoryBudgetError as e:
            raise (MemoryBudgetError(f"tensor-parallel rank {rank}: {e}") if len(profiles) > 1 else e) from None
        log.info("memory%s: %s", f" (rank {rank})" if len(profiles) > 1 else "", plans[-1].describe(profile))
    return min(p.num_blocks for p in plans)
