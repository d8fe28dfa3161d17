"""One dummy step at the engine's largest shape: max_num_batched_tokens prompt tokens through the model,
prompt logprobs over every row of it (the same sliced path the engine takes), then max_num_seqs rows through
the sampler with every filter on. On CUDA it returns the peak memory the step needed above what was
allocated before it (the memory budget's activation term); anywhere it also serves as a warm-up. It runs on
a temporary KV cache the runner swaps in for it (ModelRunner.temporary_kv_cache), allocated after the
"before" reading and subtracted once from the peak."""
from __future__ import annotations

from typing import Protocol

import torch

from shared.engine.model_runner import ModelRunner
from shared.engine.prompt_logprobs import record_prompt_logprobs
from shared.engine.sampler import Sampler
from shared.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from shared.engine.sequence import Sequence


class MemoryCounter(Protocol):
    """The allocator's counters (torch.cuda's on a GPU; tests pass a fake one)."""

    def sync(self) -> None: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...


class CudaMemory:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def profile_run(runner: ModelRunner, sampler: Sampler, kv_dtype: torch.dtype, max_num_batched_tokens: int,
                max_num_seqs: int, max_model_len: int, memory: MemoryCounter | None = None) -> int:
    """Peak bytes of one worst-case step above the memory allocated before it (0 without a counter: off CUDA)."""
    bs, device = runner.block_size, runner.device
    if memory is None and device.startswith("cuda"):
        memory = CudaMemory(device)
    plan: list[tuple[Sequence, int]] = []
    next_block, remaining = 0, max_num_batched_tokens
    # Every prompt asks for the most prompt logprobs there are: their fp32 logits are part of the peak.
    prompt_params = SamplingParams(max_tokens=1, prompt_logprobs=MAX_TOP_LOGPROBS)
    while remaining:
        n = min(remaining, max_model_len - 1)
        seq = Sequence(f"profile-{len(plan)}", [0] * (n + 1), prompt_params)
        blocks = -(-(n + 1) // bs)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        plan.append((seq, n))
        remaining -= n
    rows = list(range(min(max_num_seqs, max_num_batched_tokens)))
    prompt_rows, at = [], 0
    for seq, n in plan:
        prompt_rows += [(at + i, seq, i + 1) for i in range(n)]
        at += n
    worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                           logprobs=MAX_TOP_LOGPROBS)
    samplers = [Sequence(f"profile-s{i}", [0], worst) for i in range(len(rows))]
    before = 0
    if memory is not None:
        memory.sync()
        before = memory.allocated()  # weights and whatever else lives on; the temporary cache comes next
    try:
        with runner.temporary_kv_cache(next_block, kv_dtype) as temp_cache:
            if memory is not None:
                memory.reset_peak()
            logits, hidden = runner.execute_rows(plan, rows, [r for r, _, _ in prompt_rows])
            record_prompt_logprobs(runner.prompt_logits, hidden, prompt_rows)  # TP: every rank's head runs
            del hidden
            sampler.sample(logits, samplers)
            if memory is None:
                return 0
            memory.sync()
            return max(memory.peak() - before - temp_cache, 0)
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
