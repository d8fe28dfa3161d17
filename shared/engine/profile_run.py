"""One dummy step at the engine's largest shape: max_num_batched_tokens prompt tokens through the model,
prompt logprobs over every row of it (the same sliced path the engine takes), then max_num_seqs rows through
the sampler with every filter on. On CUDA it returns the peak memory the step needed above what was
allocated before it (the memory budget's activation term); anywhere it also serves as a warm-up. A draft
model (speculative decoding) is profiled the same way (profile_draft) at its largest forward. It runs on
a temporary KV cache the runner swaps in for it (ModelRunner.temporary_kv_cache), allocated after the
"before" reading and subtracted once from the peak. The peak is the allocator's reserved peak
(memory_budget.step_peak): what the worker's budget is checked against."""
from __future__ import annotations

from typing import Protocol

import torch

from shared.engine.memory_budget import step_peak
from shared.engine.model_runner import ModelRunner
from shared.engine.prompt_logprobs import record_prompt_logprobs
from shared.engine.sampler import Sampler, sampling_probs
from shared.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from shared.engine.sequence import Sequence


class MemoryCounter(Protocol):
    """The allocator's counters (torch.cuda's on a GPU; tests pass a fake one)."""

    def sync(self) -> None: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...

    def peak_reserved(self) -> int: ...


class CudaMemory:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        # Free cached blocks first (the loader's, say): the reserved peak then counts what the step holds.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)


def dummy_prompts(block_size: int, tokens: int, max_model_len: int, params: SamplingParams
                  ) -> tuple[list[tuple[Sequence, int]], int]:
    """Prompt chunks of `tokens` tokens in all, each at most a full-length prompt, over distinct blocks of a
    temporary pool; (plan, blocks the pool needs)."""
    plan: list[tuple[Sequence, int]] = []
    next_block, remaining = 0, tokens
    while remaining:
        n = min(remaining, max_model_len - 1)
        seq = Sequence(f"profile-{len(plan)}", [0] * (n + 1), params)
        blocks = -(-(n + 1) // block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        plan.append((seq, n))
        remaining -= n
    return plan, next_block


def profile_run(runner: ModelRunner, sampler: Sampler, kv_dtype: torch.dtype, max_num_batched_tokens: int,
                max_num_seqs: int, max_model_len: int, memory: MemoryCounter | None = None) -> int:
    """Reserved peak bytes of one worst-case step above the memory allocated before it (memory_budget.step_peak;
    0 without a counter: off CUDA)."""
    bs, device = runner.block_size, runner.device
    if memory is None and device.startswith("cuda"):
        memory = CudaMemory(device)
    # Every prompt asks for the most prompt logprobs there are: their fp32 logits are part of the peak.
    prompt_params = SamplingParams(max_tokens=1, prompt_logprobs=MAX_TOP_LOGPROBS)
    plan, next_block = dummy_prompts(bs, max_num_batched_tokens, max_model_len, prompt_params)
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
            return step_peak(before, temp_cache, memory.peak(), memory.peak_reserved())
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


@torch.inference_mode()
def profile_draft(runner: ModelRunner, kv_dtype: torch.dtype, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int, memory: MemoryCounter | None = None) -> int:
    """Peak bytes of a draft model's largest forward above the memory allocated before it (0 off CUDA): a first
    drafting forward of max_num_batched_tokens tokens (its catch-up keeps every forward within that:
    shared/engine/spec/draft_model.py) with max_num_seqs rows drafting from the worst sampling distribution. The
    draft runs before the target's step, never beside it: the engine's activation term is the larger peak."""
    if memory is None and runner.device.startswith("cuda"):
        memory = CudaMemory(runner.device)
    worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)
    plan, blocks = dummy_prompts(runner.block_size, max_num_batched_tokens, max_model_len, worst)
    rows = list(range(max_num_batched_tokens - min(max_num_seqs, max_num_batched_tokens), max_num_batched_tokens))
    before = 0
    if memory is not None:
        memory.sync()
        before = memory.allocated()
    try:
        with runner.temporary_kv_cache(blocks, kv_dtype) as temp_cache:
            if memory is not None:
                memory.reset_peak()
            logits = runner.execute_rows(plan, rows, [])[0].float()
            sampling_probs(logits, [worst] * len(rows))
            del logits
            if memory is None:
                return 0
            memory.sync()
            return step_peak(before, temp_cache, memory.peak(), memory.peak_reserved())
    finally:
        if runner.device.startswith("cuda"):
            torch.cuda.empty_cache()
