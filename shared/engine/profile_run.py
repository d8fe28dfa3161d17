"""One dummy step at the engine's largest shape: max_num_batched_tokens prompt tokens through the model,
then max_num_seqs rows through the sampler with every filter on. On CUDA it returns the peak memory
the step needed above what was allocated before (the memory budget's activation term); anywhere it
also serves as a warm-up. It uses a temporary KV cache of its own, which is freed and not counted."""
from __future__ import annotations

import torch

from shared.engine.kv_cache import allocate_kv_cache
from shared.engine.model_runner import ModelRunner
from shared.engine.sampler import Sampler
from shared.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from shared.engine.sequence import Sequence


def profile_run(runner: ModelRunner, sampler: Sampler, kv_dtype: torch.dtype, max_num_batched_tokens: int,
                max_num_seqs: int, max_model_len: int) -> int:
    """Peak bytes of one worst-case step above the memory allocated before it (0 off CUDA)."""
    cfg, bs, device = runner.model.cfg, runner.block_size, runner.device
    plan: list[tuple[Sequence, int]] = []
    next_block, remaining = 0, max_num_batched_tokens
    while remaining:
        n = min(remaining, max_model_len - 1)
        seq = Sequence(f"profile-{len(plan)}", [0] * n, SamplingParams(max_tokens=1))
        blocks = -(-n // bs)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        plan.append((seq, n))
        remaining -= n
    rows = list(range(min(max_num_seqs, max_num_batched_tokens)))
    worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                           logprobs=MAX_TOP_LOGPROBS)
    samplers = [Sequence(f"profile-s{i}", [0], worst) for i in range(len(rows))]
    on_cuda = device.startswith("cuda")
    kv_caches = runner.kv_caches
    runner.kv_caches = allocate_kv_cache(cfg, next_block, bs, kv_dtype, device)
    try:
        if on_cuda:
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        sampler.sample(runner.execute(plan, rows), samplers)
        if not on_cuda:
            return 0
        torch.cuda.synchronize(device)
        temp_cache = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
        return max(torch.cuda.max_memory_allocated(device) - before - temp_cache, 0)
    finally:
        runner.kv_caches = kv_caches
        if on_cuda:
            torch.cuda.empty_cache()
