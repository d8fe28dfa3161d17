"""The GPU memory budget (pure arithmetic, vLLM's rule), its profiling step on CPU, and FP8 KV end to end."""
from __future__ import annotations

import pytest
import torch

from shared.engine.errors import MemoryBudgetError
from shared.engine.kv_cache import bytes_per_block
from shared.engine.memory_budget import GIB, MemoryProfile, plan_kv_pool, step_peak
from shared.engine.profile_run import profile_run
from shared.kv_blocks import KVBlocks
from tests.engine_helpers import greedy, make_engine, random_prompts

H100 = 80 * GIB


def _profile(**kw) -> MemoryProfile:
    base = dict(total_bytes=H100, free_at_start=79 * GIB, weights_bytes=int(1.2 * GIB),
                peak_activation_bytes=2 * GIB, non_torch_bytes=GIB // 2, graph_reserve_bytes=256 << 20)
    base.update(kw)
    return MemoryProfile(**base)


def test_the_pool_is_the_budget_of_total_memory_minus_everything_else():
    per_block = 1 << 20
    plan = plan_kv_pool(_profile(), 0.9, per_block, min_blocks=100)
    expected = int(H100 * 0.9) - int(1.2 * GIB) - 2 * GIB - GIB // 2 - (256 << 20)
    assert plan.kv_bytes == expected and plan.num_blocks == expected // per_block
    # Two workers splitting one GPU: the second starts with the first's share gone and still fits.
    second = plan_kv_pool(_profile(free_at_start=79 * GIB - 36 * GIB), 0.45, per_block, min_blocks=100)
    assert second.budget_bytes == int(H100 * 0.45) and second.num_blocks > 0


def test_the_step_term_is_the_reserved_peak_above_the_weights_less_the_temporary_cache():
    weights, temp, activations, slack = int(1.2 * GIB), 512 << 20, 3 * GIB, 700 << 20
    peak_allocated = weights + temp + activations
    assert step_peak(weights, temp, peak_allocated, peak_allocated + slack) == activations + slack
    assert step_peak(weights, temp, peak_allocated, peak_allocated) == activations  # an allocator with no slack
    assert step_peak(weights, temp, weights + temp, weights) == 0  # never below nothing


def test_a_pool_sized_from_the_reserved_peak_keeps_the_workers_reserved_peak_in_its_budget():
    """Two workers at 0.4 each on one GPU: each one's reserved peak plus its memory outside torch must stay within
    its 0.4. Sized from the allocated peak, the pool leaves the reserved peak over by the allocator's slack."""
    weights, temp, activations, slack = int(1.2 * GIB), 512 << 20, 3 * GIB, 700 << 20
    non_torch, graphs, per_block = GIB // 2, 256 << 20, 1 << 20
    peak_allocated = weights + temp + activations
    peak_reserved = peak_allocated + slack

    def serving_reserved(num_blocks: int) -> int:
        # What the allocator holds while serving: the weights' and a step's segments as profiled (less the
        # temporary cache, which the real pool replaces), the pool, the graphs' pool.
        return peak_reserved - temp + num_blocks * per_block + graphs

    def plan(step: int):  # noqa: ANN202 - a KVPoolPlan
        profile = _profile(total_bytes=H100, free_at_start=H100, weights_bytes=weights, peak_activation_bytes=step,
                           non_torch_bytes=non_torch, graph_reserve_bytes=graphs)
        return plan_kv_pool(profile, 0.4, per_block, min_blocks=100)

    new = plan(step_peak(weights, temp, peak_allocated, peak_reserved))
    assert serving_reserved(new.num_blocks) + non_torch <= new.budget_bytes == int(H100 * 0.4)
    old = plan(activations)  # the allocated peak alone
    assert serving_reserved(old.num_blocks) + non_torch > old.budget_bytes
    assert old.num_blocks - new.num_blocks == slack // per_block


def test_a_budget_taken_by_another_process_fails_at_start_with_the_numbers():
    with pytest.raises(MemoryBudgetError, match=r"only 20\.00 GiB was free.*at most 0\.25"):
        plan_kv_pool(_profile(free_at_start=20 * GIB), 0.9, 1 << 20, min_blocks=1)


def test_a_budget_too_small_for_one_full_request_says_what_to_change():
    with pytest.raises(MemoryBudgetError, match=r"one full-length request \(5000 KV blocks.*--gpu-memory-utilization >= 0\.1[0-9]"):
        plan_kv_pool(_profile(), 0.06, 1 << 20, min_blocks=5000)


def test_profile_run_drives_a_worst_case_step_on_cpu(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    runner = engine.runner
    caches = runner.kv_caches
    assert profile_run(runner, engine.sampler, engine.kv_dtype, 96, 8, 40) == 0  # no peak counters off CUDA
    assert runner.kv_caches is caches, "the real KV pool is back in place"
    out = engine.generate(random_prompts([9]), greedy(4), use_tqdm=False)[0]
    assert len(out.output_token_ids) == 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_kv_runs_end_to_end_and_agrees_with_full_precision(checkpoints, arch):
    ckpt = checkpoints[arch]
    prompts = random_prompts([5, 17, 33, 40, 64, 80, 100, 120], seed=3)
    full = make_engine(ckpt).generate(prompts, greedy(16, None), use_tqdm=False)
    fp8_engine = make_engine(ckpt, kv_cache_dtype="fp8")
    assert fp8_engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    fp8 = fp8_engine.generate(prompts, greedy(16, None), use_tqdm=False)
    assert all(len(o.output_token_ids) == 16 for o in fp8)
    first = sum(a.output_token_ids[0] == b.output_token_ids[0] for a, b in zip(full, fp8))
    assert first >= 6, f"only {first}/8 first tokens agree with the full-precision cache"
    mc = fp8_engine.model_config
    assert bytes_per_block(mc, 16, torch.float32) == 4 * bytes_per_block(mc, 16, torch.float8_e4m3fn)
    assert fp8_engine.block_manager.root != make_engine(ckpt).block_manager.root, "fp8 blocks hash apart"


def test_fp8_blocks_round_trip_and_refuse_other_dtypes(checkpoints):
    engine = make_engine(checkpoints["llama"], kv_cache_dtype="fp8")
    prompt = random_prompts([40])[0]
    engine.generate([prompt], greedy(2), use_tqdm=False)
    k, v = engine.read_blocks([0, 1])
    assert k.dtype == torch.float8_e4m3fn
    engine.reserve("r", prompt, greedy(2))
    engine.write_blocks("r", KVBlocks(k, v, 0))
    table = engine.scheduler.held["r"].block_table[:2]
    back_k, back_v = engine.read_blocks(table)
    assert torch.equal(back_k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(back_v.view(torch.uint8), v.view(torch.uint8))
    with pytest.raises(ValueError, match="cannot be written into a torch.float8_e4m3fn cache"):
        engine.write_blocks("r", KVBlocks(k.float(), v.float(), 0))


class FakeMemory:
    """A device allocator in numbers: each tensor handed to track() counts while it is alive; the allocator holds
    `slack` bytes more than that at its peak (its rounding and free parts of segments)."""

    def __init__(self, start: int, slack: int = 0) -> None:
        self.now = self.high = start
        self.slack = slack

    def track(self, t: torch.Tensor) -> torch.Tensor:
        import weakref

        n = t.numel() * t.element_size()
        self.now += n
        self.high = max(self.high, self.now)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.now -= n

    def sync(self) -> None:
        pass

    def allocated(self) -> int:
        return self.now

    def reset_peak(self) -> None:
        self.high = self.now

    def peak(self) -> int:
        return self.high

    def peak_reserved(self) -> int:
        return self.high + self.slack


def _profile_with_fake_memory(monkeypatch, engine, activation_bytes: int, tokens: int, seqs: int,
                              slack: int = 0) -> tuple[int, dict]:
    import shared.engine.model_runner as mr

    mem = FakeMemory(start=123_456, slack=slack)
    seen = {"logit_rows": [], "temp": 0}
    real_alloc = mr.allocate_kv_cache

    def alloc(*a, **kw):
        caches = real_alloc(*a, **kw)
        for layer in caches:
            for t in layer:
                seen["temp"] += t.numel() * t.element_size()
                mem.track(t)
        return caches

    runner, model = engine.runner, engine.model
    real_execute, real_logits = runner.execute_rows, model.compute_logits

    def execute_rows(*a):
        act = mem.track(torch.empty(activation_bytes, dtype=torch.uint8))  # the forward's activations
        out = real_execute(*a)
        del act
        return out

    def compute_logits(hidden):
        seen["logit_rows"].append(hidden.shape[0])
        return mem.track(real_logits(hidden))

    monkeypatch.setattr(mr, "allocate_kv_cache", alloc)  # the runner allocates its temporary cache
    monkeypatch.setattr(runner, "execute_rows", execute_rows)
    monkeypatch.setattr(model, "compute_logits", compute_logits)
    peak = profile_run(runner, engine.sampler, engine.kv_dtype, tokens, seqs, 40, memory=mem)
    return peak, seen


def test_profile_counts_the_temporary_cache_once_and_the_forward_in_full(monkeypatch, checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    vocab = engine.model_config.vocab_size
    act = 50 << 20  # far above any logits here, so the forward is the peak
    peak, seen = _profile_with_fake_memory(monkeypatch, engine, act, tokens=96, seqs=8)
    assert seen["temp"] > 0
    # Above "before" (taken before the temporary cache): the cache itself, then the activations and the sampled
    # rows' logits. Subtracting the cache twice (the "before" read after it was allocated) would lose seen["temp"].
    assert peak == act + 8 * vocab * 4


def test_profile_counts_what_the_allocator_reserves_beyond_its_tensors(monkeypatch, checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    vocab = engine.model_config.vocab_size
    act, slack = 50 << 20, 7 << 20
    peak, _ = _profile_with_fake_memory(monkeypatch, engine, act, tokens=96, seqs=8, slack=slack)
    assert peak == act + 8 * vocab * 4 + slack


def test_prompt_logprobs_of_a_full_chunk_are_in_the_profile_in_slices(monkeypatch, checkpoints):
    from shared.engine.prompt_logprobs import PROMPT_LOGPROB_SLICE

    engine = make_engine(checkpoints["qwen3"], max_num_batched_tokens=PROMPT_LOGPROB_SLICE + 40)
    vocab = engine.model_config.vocab_size
    tokens = PROMPT_LOGPROB_SLICE + 40
    peak, seen = _profile_with_fake_memory(monkeypatch, engine, 0, tokens=tokens, seqs=8)
    sample_rows, *slices = seen["logit_rows"]
    assert sample_rows == 8 and slices == [PROMPT_LOGPROB_SLICE, 40], "every prompt row, in bounded slices"
    assert peak == (8 + PROMPT_LOGPROB_SLICE) * vocab * 4  # sampled rows' logits live beside the largest slice
