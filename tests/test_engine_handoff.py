"""KV computed by one engine and written into another (remote prefill, kvstore reuse) gives exactly
the output of a local run."""
from __future__ import annotations

from shared.kv_blocks import KVBlocks
from shared.sampling_params import SamplingParams
from tests.engine_helpers import assert_all_free, assert_matches_hf, greedy, make_engine, random_prompts, \
    run_to_completion


def remote_prefill(decode, prefill, rid, prompt, params):
    res = decode.reserve(rid, prompt, params)
    assert res is not None
    first_block = res.num_cached_tokens // decode.config.block_size
    prefill.add_request(rid, prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}),
                        capture_kv_from_block=first_block)
    # As a prefill worker pushes them: each chunk's completed blocks as they come, the rest at the end.
    pieces, out = [], None
    while out is None:
        for o in prefill.step():
            if o.request_id == rid and o.kv_blocks is not None:
                pieces.append((o.kv_blocks.first_block, o.kv_blocks.num_blocks))
                decode.write_blocks(rid, o.kv_blocks)
            if o.request_id == rid and o.finished:
                out = o
    # Every block exactly once, in order, however the prompt was chunked.
    assert [b for b, _ in pieces] == [first_block + sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert sum(n for _, n in pieces) == res.num_blocks - first_block
    lp = out.logprobs[0] if out.logprobs else None
    return res, decode.commit_held(rid, len(prompt), out.output_token_ids[0], lp), len(pieces)


def test_remote_prefill_then_local_decode_matches_transformers(checkpoints, hf_reference):
    ckpt = checkpoints["qwen3"]
    decode, prefill = make_engine(ckpt), make_engine(ckpt, max_num_batched_tokens=24)
    prompts = random_prompts([5, 16, 40, 77], seed=11)
    for i, p in enumerate(prompts):  # 40 and 77 tokens take several 24-token chunks: several pieces
        _, first, pieces = remote_prefill(decode, prefill, f"r{i}", p, greedy(12))
        # A streamed output carries the new token only (the finished one carries the whole output).
        assert first is not None and len(first.new_token_ids) == 1 and not first.finished
        assert first.output_token_ids == [] and first.prompt_token_ids == []
        assert pieces == -(-len(p) // 24) if len(p) > 24 else pieces == 1
    done = run_to_completion(decode)
    assert_matches_hf(ckpt, hf_reference, prompts, [done[f"r{i}"] for i in range(len(prompts))], 12)
    assert_all_free(decode)
    assert_all_free(prefill)


def test_remote_prefill_after_partial_local_prefix_hit(checkpoints, hf_reference):
    ckpt = checkpoints["llama"]
    decode, prefill = make_engine(ckpt), make_engine(ckpt)
    shared = random_prompts([40], seed=12)[0]
    decode.generate([shared + [1]], greedy(2), use_tqdm=False)
    prompt = shared + random_prompts([30], seed=13)[0]
    res, _, _ = remote_prefill(decode, prefill, "x", prompt, greedy(10))
    assert res.num_cached_tokens == 32
    done = run_to_completion(decode)
    assert_matches_hf(ckpt, hf_reference, [prompt], [done["x"]], 10)
    assert_all_free(decode)


def test_seeded_sampling_identical_with_remote_first_token(checkpoints):
    ckpt = checkpoints["llama"]
    params = SamplingParams(max_tokens=15, temperature=1.0, seed=99, top_p=0.9)
    prompt = random_prompts([33], seed=14)[0]
    local = make_engine(ckpt).generate([prompt], params, use_tqdm=False)[0].output_token_ids
    decode, prefill = make_engine(ckpt), make_engine(ckpt)
    remote_prefill(decode, prefill, "s", prompt, params)
    assert run_to_completion(decode)["s"].output_token_ids == local


def test_blocks_from_another_engine_then_local_prefill(checkpoints, hf_reference):
    """The kvstore path: full blocks computed elsewhere cover a prefix; the tail is prefilled locally."""
    ckpt = checkpoints["mistral"]
    source, decode = make_engine(ckpt), make_engine(ckpt)
    prompt = random_prompts([70], seed=15)[0]
    source.generate([prompt], greedy(1), use_tqdm=False)
    res = decode.reserve("y", prompt, greedy(10))
    hits = [source.block_manager.cached[h] for h in res.block_hashes]
    assert len(hits) == 4  # 70 tokens: 4 full blocks
    k, v = source.read_blocks(hits)
    decode.write_blocks("y", KVBlocks(k, v, 0))
    decode.commit_held("y", len(hits) * 16)
    out = run_to_completion(decode)["y"]
    assert_matches_hf(ckpt, hf_reference, [prompt], [out], 10)
    assert decode.stats().num_preemptions == 0
    assert_all_free(decode)


def test_release_held_falls_back_to_local_compute(checkpoints, hf_reference):
    ckpt = checkpoints["qwen2"]
    decode = make_engine(ckpt)
    prompt = random_prompts([50], seed=16)[0]
    assert decode.reserve("z", prompt, greedy(8)) is not None
    decode.check_integrity()
    decode.release_held("z")
    assert_matches_hf(ckpt, hf_reference, [prompt], [run_to_completion(decode)["z"]], 8)
    assert decode.reserve("w", prompt, greedy(8)) is not None
    assert decode.abort("w").finish_reason == "abort"
    assert_all_free(decode)


def test_reserve_commits_a_local_prompt_in_the_same_command(checkpoints, hf_reference):
    """A decode worker with nothing below its device pool commits a local prompt in its Reserve command (one
    engine round trip): above the bound it stays held, below it runs from its prefix cache, like a local run."""
    from shared.engine.commands import Reserve

    ckpt = checkpoints["llama"]
    decode = make_engine(ckpt)
    prompt = random_prompts([40], seed=17)[0]
    held = Reserve("h", prompt, greedy(8), commit_if_uncached_below=40).run(decode)
    assert held is not None and not held.committed and decode.is_held("h")
    decode.release_held("h")
    first = run_to_completion(decode)["h"]
    again = Reserve("c", prompt, greedy(8), commit_if_uncached_below=41).run(decode)
    assert again is not None and again.committed and again.num_cached_tokens == 32 and not decode.is_held("c")
    out = run_to_completion(decode)["c"]
    assert out.output_token_ids == first.output_token_ids
    assert_matches_hf(ckpt, hf_reference, [prompt], [out], 8)
    assert_all_free(decode)


def test_reserve_commits_a_prompt_whose_whole_prefix_is_cached(checkpoints, hf_reference):
    """A decode worker with tiers below its device pool (kvstore, host tier) commits a local prompt in its Reserve
    command when the device cache holds every full block of the prompt (the tiers have nothing to add); a prompt
    with an uncached full block stays held for the tiers' lookup."""
    from shared.engine.commands import Reserve

    ckpt = checkpoints["llama"]
    decode = make_engine(ckpt)
    prompt = random_prompts([40], seed=23)[0]  # two full blocks of 16, then 8 tokens
    held = Reserve("h", prompt, greedy(8), commit_if_prefix_cached_below=100).run(decode)
    assert held is not None and not held.committed and decode.is_held("h")  # its blocks may be in a lower tier
    decode.release_held("h")
    first = run_to_completion(decode)["h"]
    # One full block cached, the second one new: the lookup may still find it, so the request waits for it.
    other = prompt[:16] + random_prompts([24], seed=24)[0]
    part = Reserve("p", other, greedy(8), commit_if_prefix_cached_below=100).run(decode)
    assert part is not None and not part.committed and part.num_cached_tokens == 16
    decode.release_held("p")
    run_to_completion(decode)
    # Every full block cached, 8 tokens left: committed at once below the bound, held at it.
    at_bound = Reserve("b", prompt, greedy(8), commit_if_prefix_cached_below=8).run(decode)
    assert at_bound is not None and not at_bound.committed
    decode.release_held("b")
    run_to_completion(decode)
    again = Reserve("c", prompt, greedy(8), commit_if_prefix_cached_below=9).run(decode)
    assert again is not None and again.committed and again.num_cached_tokens == 32 and not decode.is_held("c")
    out = run_to_completion(decode)["c"]
    assert out.output_token_ids == first.output_token_ids
    assert_matches_hf(ckpt, hf_reference, [prompt], [out], 8)
    assert_all_free(decode)


def test_fp8_kv_moves_between_engines_byte_for_byte(checkpoints):
    """An FP8 KV cache's blocks, read chunk by chunk on one engine and written into another, give the
    tokens a local FP8 run gives (the bytes are the same; FP8 has no CPU index_copy, reads use index_select)."""
    ckpt = checkpoints["llama"]
    prompt = random_prompts([77], seed=17)[0]
    local = make_engine(ckpt, kv_cache_dtype="fp8").generate([prompt], greedy(10), use_tqdm=False)[0]
    decode = make_engine(ckpt, kv_cache_dtype="fp8")
    prefill = make_engine(ckpt, kv_cache_dtype="fp8", max_num_batched_tokens=24)
    _, _, pieces = remote_prefill(decode, prefill, "f", prompt, greedy(10))
    assert pieces == 4
    assert run_to_completion(decode)["f"].output_token_ids == local.output_token_ids
    assert_all_free(decode)
    assert_all_free(prefill)
