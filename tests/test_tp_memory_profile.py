"""Issue 22, the GPU-only paths of tensor parallelism as far as this CPU runs them. The memory profile runs across a
tensor-parallel worker's ranks (as far as this CPU allows: the
allocator counters are CUDA's, so the figures are 0 here; the per-rank plan itself is tests/test_tp_placement.py).
Every rank swaps the profile's temporary KV cache in for the broadcast worst-case step, prompt logprobs included,
reports its memory to rank 0, and swaps its real cache back: KV computed before the profile still serves a prefix
hit after it, and tokens equal TP=1's. Decode graphs: every rank builds the same buckets (captured in step on CUDA;
here the same padded path eagerly) and decode steps broadcast only their staged rows: tokens equal TP=1's."""
from __future__ import annotations

from shared.engine.profile_run import profile_run
from shared.engine.tp.rank_memory import FIELDS
from tests.engine_helpers import greedy, make_engine, random_prompts


def test_profile_runs_on_every_rank_and_leaves_the_real_caches(checkpoints) -> None:
    ckpt = checkpoints["qwen3"]
    prefix = random_prompts([48], seed=9)[0]
    second = prefix + [5, 6, 7]
    tp2 = make_engine(ckpt, tensor_parallel_size=2)
    try:
        first = tp2.generate([prefix], greedy(4, None), use_tqdm=False)[0].output_token_ids
        real = [t.data_ptr() for layer in tp2.runner.kv_caches for t in layer]
        assert profile_run(tp2.runner, tp2.sampler, tp2.kv_dtype, 96, 4, 64) == 0  # no CUDA counters here
        assert [t.data_ptr() for layer in tp2.runner.kv_caches for t in layer] == real
        assert tp2.runner.rank_memory() == [[0] * FIELDS]
        out = tp2.generate([second], greedy(6, None), use_tqdm=False)[0]
        assert out.num_cached_tokens == 48  # the prefix's blocks, computed before the profile, on every rank
        tokens = out.output_token_ids
    finally:
        tp2.shutdown()
    tp1 = make_engine(ckpt)
    assert first == tp1.generate([prefix], greedy(4, None), use_tqdm=False)[0].output_token_ids
    assert tokens == tp1.generate([second], greedy(6, None), use_tqdm=False)[0].output_token_ids


def test_decode_graphs_run_on_every_rank(checkpoints) -> None:
    ckpt = checkpoints["llama"]
    prompts = random_prompts([5, 17, 33], seed=12)
    tp2 = make_engine(ckpt, tensor_parallel_size=2)
    try:
        graphs = tp2.runner.use_decode_graphs(tp2.max_model_len, 8, capture=False)
        replays: list[int] = []
        replay = graphs.replay
        graphs.replay = lambda bs, n: (replays.append(bs), replay(bs, n))[1]
        ours = [o.output_token_ids for o in tp2.generate(prompts, greedy(10, None), use_tqdm=False)]
    finally:
        tp2.shutdown()
    assert len(replays) >= 9  # the decode steps went through the graphs' path (and the followers' too: exact)
    tp1 = make_engine(ckpt)
    assert ours == [o.output_token_ids for o in tp1.generate(prompts, greedy(10, None), use_tqdm=False)]
