"""Tensor parallelism on this CPU (gloo): a TP=2 engine (rank 0 here, rank 1 a follower process) gives exactly
the single-device engine's and transformers' greedy tokens, with GQA heads split across ranks, chunked prefill,
prefix-cache hits, mixed batches and prompt logprobs; KV leaves and enters it as whole blocks (all heads), so
TP=1 and TP=2 engines exchange blocks; at TP=4 the 2 KV heads are replicated on 2 ranks each; bad degrees are refused before any process starts; a rank killed mid-run
fails the engine with one clear error instead of a hang."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch
from torch import nn

from shared.engine.tp.launch import TPRankError
from shared.kv_blocks import KVBlocks
from shared.models.loader import load_model
from shared.models.model_config import load_model_config
from shared.models.tp.degree import TPDegreeError, check_degree, shard_of
from shared.sampling_params import SamplingParams
from tests.engine_helpers import assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts, \
    run_to_completion

MIXED_LENGTHS = [1, 5, 16, 17, 31, 48, 64, 90, 7, 33]
MAX_NEW = 12


@pytest.fixture
def tp2_engines():
    """TP=2 engines a test makes, shut down after it even when it fails (their follower processes end too)."""
    made = []

    def make(ckpt, **overrides):
        engine = make_engine(ckpt, tensor_parallel_size=2, **overrides)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tp2_greedy_matches_tp1_and_transformers(arch, checkpoints, hf_reference, tp2_engines):
    """The four architectures (Mistral with its sliding window shorter than the longer prompts); GQA (4 query
    heads, 2 KV heads: one KV head per rank); chunks of 40 tokens cut prompts across blocks and
    share steps with decode rows; a second round hits the prefix cache."""
    ckpt = checkpoints[arch]
    tp1 = make_engine(ckpt, max_num_batched_tokens=40)
    tp2 = tp2_engines(ckpt, max_num_batched_tokens=40)
    assert tp2.tp is not None and tp2.runner.kv_caches[0][0].shape[2] == 1  # this rank's KV head only
    prompts = random_prompts(MIXED_LENGTHS, seed=1)
    ours = tp2.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert [o.output_token_ids for o in ours] == \
        [o.output_token_ids for o in tp1.generate(prompts, greedy(MAX_NEW), use_tqdm=False)]
    assert_matches_hf(ckpt, hf_reference, prompts, ours, MAX_NEW)
    # Prefix-cache hits: the same 37-token prefix (2 full blocks) with new tails.
    shared = random_prompts([37], seed=3)[0]
    tails = random_prompts([3, 12, 20], seed=4)
    tp2.generate([shared + tails[0]], greedy(MAX_NEW), use_tqdm=False)
    again = [shared + t for t in tails[1:]]
    hits = tp2.generate(again, greedy(MAX_NEW), use_tqdm=False)
    assert [o.num_cached_tokens for o in hits] == [32, 32]
    assert_matches_hf(ckpt, hf_reference, again, hits, MAX_NEW)
    assert_all_free(tp2)


def test_tp2_prompt_logprobs_match_tp1(checkpoints, tp2_engines):
    """Prompt logprobs run the output head over hidden rows in slices: every rank must run the same slices."""
    ckpt = checkpoints["qwen2"]  # q/k/v bias (split by rows) and tied embeddings (the head shares the shard)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3)
    prompts = random_prompts([20, 45], seed=5)
    a = make_engine(ckpt).generate(prompts, params, use_tqdm=False)
    b = tp2_engines(ckpt).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.output_token_ids == y.output_token_ids
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) > 1
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert p.token_id == q.token_id and abs(p.logprob - q.logprob) < 1e-4
            assert [t for t, _ in p.top] == [t for t, _ in q.top]


def test_blocks_move_whole_between_tp1_and_tp2(checkpoints, hf_reference, tp2_engines):
    """What the tiers, the kvstore and prefill pushes carry is whole blocks with all heads: blocks computed by a
    TP=1 engine are written into a TP=2 engine (scattered by heads) and the other way round (gathered)."""
    ckpt = checkpoints["mistral"]
    tp1, tp2 = make_engine(ckpt), tp2_engines(ckpt)
    prompt = random_prompts([70], seed=15)[0]
    tp1.generate([prompt], greedy(1), use_tqdm=False)
    tp2.generate([prompt], greedy(1), use_tqdm=False)
    hashes = tp1.reserve("probe", prompt, greedy(1)).block_hashes
    tp1.abort("probe")
    k1, v1 = tp1.read_blocks([tp1.block_manager.cached[h] for h in hashes])
    k2, v2 = tp2.read_blocks([tp2.block_manager.cached[h] for h in hashes])
    assert k1.shape == k2.shape and k1.shape[3] == 2  # all KV heads, from both
    torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)
    # TP=2's blocks into a fresh TP=1 engine, then TP=1's into a fresh TP=2 engine: both continue exactly.
    # (One TP engine per process at a time: torch.distributed's default group is the process's.)
    tp2.shutdown()
    for source_kv, target in (((k2, v2), lambda: make_engine(ckpt)), ((k1, v1), lambda: tp2_engines(ckpt))):
        target = target()
        res = target.reserve("y", prompt, greedy(10))
        target.write_blocks("y", KVBlocks(*source_kv, 0))
        target.commit_held("y", len(hashes) * 16)
        out = run_to_completion(target)["y"]
        assert_matches_hf(ckpt, hf_reference, [prompt], [out], 10)
        assert res.num_cached_tokens == 0 and target.stats().num_preemptions == 0
        assert_all_free(target)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp4_replicates_kv_heads(arch, checkpoints, hf_reference):
    """4 query heads, 2 KV heads at TP=4 (three follower processes): ranks 0-1 hold KV head 0, ranks 2-3 KV head 1
    (k/v rows sliced by KV head; qwen3's q/k norms too). Greedy equals TP=1 and transformers; whole blocks read
    back equal TP=1's (each head once); TP=1's blocks written in (to both replicas) continue exactly."""
    ckpt = checkpoints[arch]
    prompts = random_prompts([5, 40, 70], seed=21)
    fresh = random_prompts([50], seed=22)[0]  # computed by TP=1 only, then written into TP=4
    tp1 = make_engine(ckpt)
    expected = tp1.generate(prompts + [fresh], greedy(MAX_NEW), use_tqdm=False)
    engine = make_engine(ckpt, tensor_parallel_size=4)
    try:
        assert engine.runner.kv_caches[0][0].shape[2] == 1 and engine.runner.replicas == 2
        ours = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        assert [o.output_token_ids for o in ours] == [o.output_token_ids for o in expected[:3]]
        assert_matches_hf(ckpt, hf_reference, prompts, ours, MAX_NEW)
        hashes = tp1.reserve("probe", prompts[2], greedy(1)).block_hashes
        tp1.abort("probe")
        k1, v1 = tp1.read_blocks([tp1.block_manager.cached[h] for h in hashes])
        k4, v4 = engine.read_blocks([engine.block_manager.cached[h] for h in hashes])  # same hashes as TP=1
        assert k4.shape == k1.shape and k4.shape[3] == 2
        torch.testing.assert_close(k4, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v4, v1, atol=1e-5, rtol=1e-5)
        hashes = tp1.reserve("probe", fresh, greedy(1)).block_hashes
        tp1.abort("probe")
        kf, vf = tp1.read_blocks([tp1.block_manager.cached[h] for h in hashes])
        res = engine.reserve("y", fresh, greedy(MAX_NEW))
        engine.write_blocks("y", KVBlocks(kf, vf, 0))
        engine.commit_held("y", len(hashes) * 16)
        out = run_to_completion(engine)["y"]
        assert res.num_cached_tokens == 0 and out.output_token_ids == expected[3].output_token_ids
        assert_all_free(engine)
    finally:
        engine.shutdown()


def test_fp8_kv_cache_shards_and_moves_whole(checkpoints, tp2_engines):
    """An FP8 KV cache split by heads: blocks cross the ranks as bytes (gloo has no float8) and come back whole."""
    ckpt = checkpoints["llama"]
    prompt = random_prompts([70], seed=17)[0]
    tp1 = make_engine(ckpt, kv_cache_dtype="fp8")
    tp2 = tp2_engines(ckpt, kv_cache_dtype="fp8")
    a = tp1.generate([prompt], greedy(MAX_NEW, None), use_tqdm=False)[0]
    b = tp2.generate([prompt], greedy(MAX_NEW, None), use_tqdm=False)[0]
    assert a.output_token_ids == b.output_token_ids
    hashes = tp2.reserve("probe", prompt, greedy(1)).block_hashes
    tp2.abort("probe")
    ids = [tp2.block_manager.cached[h] for h in hashes]
    k, v = tp2.read_blocks(ids)
    assert k.dtype == torch.float8_e4m3fn and k.shape[3] == 2
    tp2.runner.write_blocks(ids, k, v)  # scattered back by heads, byte for byte
    k2, v2 = tp2.read_blocks(ids)
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8)) and torch.equal(v2.view(torch.uint8),
                                                                                  v.view(torch.uint8))


def test_tp3_pads_the_vocabulary_and_samples_like_tp1(tmp_path, hf_reference, tp2_engines):
    """6 query heads, 3 KV heads at TP=3 (two follower processes): the 512-token vocabulary splits 171/171/170,
    the last rank's padding row is zero and cut off after the gather. Greedy equals transformers; seeded
    sampling (penalties, top-p over the gathered logits) equals TP=1 token for token."""
    from tests.checkpoints import build_checkpoint

    ckpt = build_checkpoint("llama", tmp_path / "llama6", hidden_size=96, num_attention_heads=6,
                            num_key_value_heads=3, intermediate_size=192)
    prompts = random_prompts([9, 40, 23], seed=8)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=5, frequency_penalty=0.3, logprobs=3)
    tp1 = make_engine(ckpt).generate(prompts, sampled, use_tqdm=False)
    engine = make_engine(ckpt, tensor_parallel_size=3)
    try:
        assert engine.model.lm_head.weight.shape[0] == 171
        assert_matches_hf(ckpt, hf_reference, prompts, engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False),
                          MAX_NEW)
        tp3 = engine.generate(prompts, sampled, use_tqdm=False)
        assert [o.output_token_ids for o in tp3] == [o.output_token_ids for o in tp1]
    finally:
        engine.shutdown()


def test_bad_degrees_are_refused_before_any_rank_starts(checkpoints):
    ckpt = checkpoints["llama"]  # 4 query heads, 2 KV heads, intermediate 160
    cfg = load_model_config(ckpt.path)
    with pytest.raises(TPDegreeError, match=r"tensor-parallel size 3 does not divide the model's "
                                            r"num_attention_heads \(4\); this model splits into 1, 2, 4 ranks"):
        check_degree(cfg, 3)
    with pytest.raises(TPDegreeError, match=r"size 8 does not divide the model's num_attention_heads \(4\)"):
        make_engine(ckpt, tensor_parallel_size=8)
    # 12 query heads, 4 KV heads: 6 divides the query heads and the MLP but is neither a divisor of the KV heads
    # (split) nor a multiple of them (replicated).
    wide = dataclasses.replace(cfg, num_heads=12, num_kv_heads=4, intermediate_size=192)
    with pytest.raises(TPDegreeError, match=r"size 6 neither divides nor is a multiple of the model's "
                                            r"num_key_value_heads \(4\).*splits into 1, 2, 4, 12 ranks"):
        check_degree(wide, 6)
    assert [shard_of(wide, r, 12).kv_head_start for r in range(12)] == [r // 3 for r in range(12)]
    with pytest.raises(ValueError, match="tensor-parallel size must be >= 1"):
        make_engine(ckpt, tensor_parallel_size=0)
    import torch.distributed as dist

    assert not dist.is_initialized()  # nothing was started


def test_tp1_is_the_single_device_model(checkpoints):
    """TP=1 builds exactly today's modules: plain nn.Linear / nn.Embedding, no collective anywhere."""
    model, _ = load_model(checkpoints["llama"].path, dtype="float32")
    assert model.tp is None
    assert type(model.embed_tokens) is nn.Embedding and type(model.lm_head) is nn.Linear
    for layer in model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(m) is nn.Linear


def test_killed_rank_fails_the_engine_loudly(checkpoints, tp2_engines):
    ckpt = checkpoints["llama"]
    engine = tp2_engines(ckpt)
    follower = engine.tp.procs[0]
    for i, p in enumerate(random_prompts([30, 60, 9], seed=7)):
        engine.add_request(f"k{i}", p, greedy(50))
    for _ in range(3):
        engine.step()
    os.kill(follower.pid, signal.SIGKILL)
    follower.wait(10)
    start = time.monotonic()
    with pytest.raises(TPRankError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 10, "a dead rank must fail the step at once, not after a timeout"
    with pytest.raises(TPRankError, match="already failed"):
        engine.step()
    engine.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_follower_dies_with_rank_0(checkpoints, tmp_path):
    """Rank 0's process killed outright (no shutdown path runs): its follower does not linger."""
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from shared.config import EngineConfig\n"
        "from shared.engine.llm_engine import LLMEngine\n"
        f"e = LLMEngine(EngineConfig(model={str(checkpoints['llama'].path)!r}, num_kv_blocks=32, "
        "tensor_parallel_size=2))\n"
        "print(e.tp.procs[0].pid, flush=True)\n"
        "time.sleep(60)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        follower = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(follower):
            time.sleep(0.1)
        assert not _alive(follower), "the follower outlived rank 0"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1(smollm2_dir):
    """The real model at TP=3: 9 query heads and 3 KV heads split 3/1 per rank, a 49,152-token vocabulary split in
    three; greedy tokens equal the single-device engine's (itself checked against transformers in
    tests/test_smollm2.py) and top-5 logprobs agree."""
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(smollm2_dir))
    prompts = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):",
                                       "Once upon a time, in a small village,"]]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)
    outs = {}
    for tp in (1, 3):
        engine = LLMEngine(EngineConfig(model=str(smollm2_dir), dtype="float32", num_kv_blocks=64,
                                        tensor_parallel_size=tp))
        try:
            outs[tp] = engine.generate(prompts, params, use_tqdm=False)
        finally:
            engine.shutdown()
    for a, b in zip(outs[1], outs[3]):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-4


def test_rank_dying_while_idle_crashes_the_engine_thread(checkpoints):
    """A worker's engine thread idles between requests: a rank that dies then must end the worker at once (its
    supervisor restarts it), not fail the next request that happens to arrive."""
    import asyncio

    import torch.distributed as dist

    from shared.engine.engine_thread import EngineThread

    async def main():
        thread = EngineThread(asyncio.get_running_loop(), lambda *a: None)
        engine = await thread.start(lambda: make_engine(checkpoints["llama"], tensor_parallel_size=2))
        os.kill(engine.tp.procs[0].pid, signal.SIGKILL)
        await asyncio.wait_for(thread.crashed.wait(), 10)
        assert isinstance(thread.error, TPRankError) and "died while the engine was idle" in str(thread.error)
        thread.stop()

    asyncio.run(main())
    assert not dist.is_initialized()
