"""The decode-graph path: buckets, and its static padded buffers run eagerly on CPU give the same tokens."""
from __future__ import annotations

import pytest

from shared.engine.cuda_graphs import batch_buckets
from shared.sampling_params import SamplingParams
from tests.engine_helpers import greedy, make_engine, random_prompts


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and batch_buckets(256)[-1] == 256
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    for m in (1, 7, 100, 128):
        b = batch_buckets(m)
        assert b[-1] == m and all(any(x >= n for x in b) for n in range(1, m + 1))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_static_padded_decode_path_gives_the_same_tokens(checkpoints, arch):
    ckpt = checkpoints[arch]
    prompts = random_prompts([3, 17, 40, 9, 33], seed=11)  # 5 rows: padded into the bucket of 8
    plain = make_engine(ckpt).generate(prompts, greedy(20), use_tqdm=False)
    engine = make_engine(ckpt)
    graphs = engine.runner.use_decode_graphs(engine.max_model_len, 64, capture=False)
    calls = []
    run = graphs.run
    graphs.run = lambda plan: calls.append(len(plan)) or run(plan)
    static = engine.generate(prompts, greedy(20), use_tqdm=False)
    assert calls and max(calls) == 5, "decode steps went through the static path"
    for a, b in zip(plain, static):
        assert a.output_token_ids == b.output_token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_sampled_steps_through_the_static_path_are_seed_stable(checkpoints):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5)
    prompt = random_prompts([14], seed=2)[0]
    plain = make_engine(checkpoints["llama"]).generate([prompt], params, use_tqdm=False)[0]
    engine = make_engine(checkpoints["llama"])
    engine.runner.use_decode_graphs(engine.max_model_len, 8, capture=False)
    assert engine.generate([prompt], params, use_tqdm=False)[0].output_token_ids == plain.output_token_ids
