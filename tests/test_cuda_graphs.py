"""The decode-graph path: buckets, and its static padded buffers run eagerly on CPU give the same tokens."""
from __future__ import annotations

import pytest

from shared.engine.cuda_graphs import batch_buckets, row_words
from shared.sampling_params import SamplingParams
from tests.engine_helpers import greedy, make_engine, random_prompts


GRID = [1, 2, 4, 8, 16, 24, 32] + list(range(48, 1024, 16))


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert batch_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and batch_buckets(256)[-1] == 256
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    for m in (1, 7, 100, 128):
        b = batch_buckets(m)
        assert b[-1] == m and all(any(x >= n for x in b) for n in range(1, m + 1))


@pytest.mark.parametrize(("max_num_seqs", "buckets"), [
    (1, [1]),
    (3, [1, 2, 3]),  # 3 takes the place of 4
    (5, [1, 2, 4, 5]),  # 5 takes the place of 8
    (17, [1, 2, 4, 8, 16, 17]),  # 17 takes the place of 24: as many graphs as max_num_seqs=24 gets
    (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
    (250, [1, 2, 4, 8, 16, 24, 32] + list(range(48, 241, 16)) + [250]),  # 250 takes the place of 256
    (256, [1, 2, 4, 8, 16, 24, 32] + list(range(48, 257, 16))),
])
def test_the_last_bucket_is_max_num_seqs_in_place_of_the_grid_size_it_cuts(max_num_seqs, buckets):
    """Every bucket but the last is a grid size, each the grid's next, and the last is max_num_seqs in place of the
    first grid size at or above it: never one more graph than the grid has up to there (an odd max_num_seqs
    adds no bucket of its own beside the grid's). Only the last gap may be narrower than the grid's step there."""
    got = batch_buckets(max_num_seqs)
    assert got == buckets
    assert got[-1] == max_num_seqs
    assert got[:-1] == GRID[: len(got) - 1], "the grid's sizes, none skipped"
    assert len(got) == next(i for i, g in enumerate(GRID) if g >= max_num_seqs) + 1
    for i in range(1, len(got) - 1):
        assert got[i] - got[i - 1] == GRID[i] - GRID[i - 1]
    if len(got) > 1:
        assert 0 < got[-1] - got[-2] <= GRID[len(got) - 1] - GRID[len(got) - 2]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 5, 17, 64, 250, 256])
def test_every_staged_row_starts_on_a_16_byte_boundary(checkpoints, max_num_seqs):
    """Triton specialises pointers on 16-byte alignment: the rows the kernels read (positions, slots, context
    lengths) start on one whatever max_num_seqs is, so capture compiles no variant that warm-up did not."""
    engine = make_engine(checkpoints["llama"], max_num_seqs=max_num_seqs)
    graphs = engine.runner.use_decode_graphs(engine.max_model_len, max_num_seqs, capture=False)
    assert graphs.max_bs == max_num_seqs and graphs.vec.shape == (4, row_words(max_num_seqs))
    assert row_words(max_num_seqs) % 4 == 0 and 0 <= row_words(max_num_seqs) - max_num_seqs < 4
    for bs in graphs.buckets:
        meta = graphs._meta(bs)
        for t in (graphs.vec[0, :bs], graphs.vec[1, :bs], meta.slot_mapping, meta.decode_context_lens):
            assert t.data_ptr() % 16 == 0, (bs, t.data_ptr() - graphs.vec.data_ptr())
    for host_vec, _ in graphs.staging.buffers:
        assert host_vec.shape == graphs.vec.shape  # one copy of the whole block a step


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
