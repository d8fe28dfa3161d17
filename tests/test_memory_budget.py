"""The GPU memory budget (pure arithmetic, vLLM's rule), its profiling step on CPU, and FP8 KV end to end."""
from __future__ import annotations

import pytest
import torch

from shared.engine.errors import MemoryBudgetError
from shared.engine.kv_cache import bytes_per_block
from shared.engine.memory_budget import GIB, MemoryProfile, plan_kv_pool
from shared.engine.profile_run import profile_run
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
    engine.write_blocks("r", 0, k, v)
    table = engine.held["r"].block_table[:2]
    back_k, back_v = engine.read_blocks(table)
    assert torch.equal(back_k.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(back_v.view(torch.uint8), v.view(torch.uint8))
    with pytest.raises(ValueError, match="cannot be written into a torch.float8_e4m3fn cache"):
        engine.write_blocks("r", 0, k.float(), v.float())
