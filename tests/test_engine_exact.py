"""kvmesh's engine against transformers generate(), token for token, for every architecture and
under prefix-cache hits, chunked prefill, preemption and aborts."""
from __future__ import annotations

import pytest

from tests.checkpoints import ARCHS, to_transformers4_config
from tests.engine_helpers import (assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts,
                                  run_to_completion)

MIXED_LENGTHS = [1, 5, 16, 17, 31, 48, 64, 90, 7, 33]
MAX_NEW = 16


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_batch_matches_transformers(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt)
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    outputs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_matches_hf(ckpt, hf_reference, prompts, outputs, MAX_NEW)
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers4_style_config_loads_the_same(arch, checkpoints, hf_reference, tmp_path):
    import shutil

    ckpt = checkpoints[arch]
    old_style = tmp_path / "old"
    shutil.copytree(ckpt.path, old_style)
    to_transformers4_config(old_style)
    engine = make_engine(ckpt, model=str(old_style))
    prompts = random_prompts([20, 70], seed=2)
    assert_matches_hf(ckpt, hf_reference, prompts, engine.generate(prompts, greedy(8), use_tqdm=False), 8)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_prefix_cache_hits_mid_block(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt)
    shared = random_prompts([37], seed=3)[0]  # 2 full blocks + 5 tokens: only full blocks are shared
    tails = random_prompts([3, 12, 20, 1], seed=4)
    first = engine.generate([shared + tails[0]], greedy(MAX_NEW), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    prompts = [shared + t for t in tails[1:]] + [shared + tails[0]]
    outputs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [32, 32, 32, 32]
    assert_matches_hf(ckpt, hf_reference, [shared + tails[0]] + prompts, first + outputs, MAX_NEW)
    assert engine.stats().prefix_cache_hit_rate > 0
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_chunked_prefill_splits_prompts_mid_block(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt, max_num_batched_tokens=13)  # chunks of 13 cut across 16-token blocks
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    outputs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_matches_hf(ckpt, hf_reference, prompts, outputs, MAX_NEW)
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preemption_by_recompute(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt, num_kv_blocks=14, max_num_batched_tokens=64)  # 224 slots for ~400 tokens
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    outputs = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert_matches_hf(ckpt, hf_reference, prompts, outputs, MAX_NEW)
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_aborts_midway_leave_others_exact(arch, checkpoints, hf_reference):
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt, max_num_batched_tokens=40)
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(MAX_NEW))
    for _ in range(4):  # some still prefilling, some decoding
        engine.step()
    aborted = {"r1", "r6", "r7"}
    for rid in aborted:
        out = engine.abort(rid)
        assert out is not None and out.finished and out.finish_reason == "abort"
    engine.check_integrity()
    done = run_to_completion(engine)
    assert set(done) == {f"r{i}" for i in range(len(prompts))} - aborted
    keep = [i for i in range(len(prompts)) if f"r{i}" not in aborted]
    assert_matches_hf(ckpt, hf_reference, [prompts[i] for i in keep], [done[f"r{i}"] for i in keep], MAX_NEW)
    assert engine.abort("r1") is None  # aborting twice is harmless
    assert_all_free(engine)
