"""Verify graphs of speculative decoding (shared/engine/verify_buckets.py, shared/engine/verify_graphs.py): the
capture plan, and the padded static path run eagerly on CPU: the same greedy tokens as the unpadded verify, over
mixed draft lengths and batch sizes that hit several buckets, and KV written only into the step's real slots."""
from __future__ import annotations

import pytest
import torch

from shared.engine.verify_buckets import PER_GRAPH_BYTES, draft_buckets, plan_verify_graphs
from shared.engine.verify_graphs import VerifyGraphs
from shared.sampling_params import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.engine_helpers import assert_all_free, greedy, make_engine, random_prompts, run_to_completion

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


# --- the capture plan ---------------------------------------------------------------------------------------


def test_draft_buckets_every_length_then_powers_of_two():
    assert draft_buckets(1) == [1]
    assert draft_buckets(5) == [1, 2, 3, 4, 5]
    assert draft_buckets(12) == [1, 2, 4, 8, 12]
    assert draft_buckets(16) == [1, 2, 4, 8, 16]


def test_plan_caps_requests_at_the_adaptive_threshold_and_the_token_budget():
    p = plan_verify_graphs(4, max_num_seqs=256, disable_by_batch_size=8, max_num_batched_tokens=8192,
                           max_model_len=4096, block_size=16)
    assert p.request_buckets() == [1, 2, 4, 8] and p.count == 16 and (p.max_bs, p.max_k) == (8, 4)
    assert p.shapes[0] == (8, 4) and p.max_tokens == 40 and p.width == 256
    tokens = [bs * (k + 1) for bs, k in p.shapes]
    assert tokens == sorted(tokens, reverse=True), "captured largest first, so smaller graphs reuse the pool"
    # No threshold: every decode bucket; a small token budget drops the shapes no step can have.
    p = plan_verify_graphs(3, 64, 0, 100, 2048, 16)
    assert p.request_buckets() == [1, 2, 4, 8, 16, 24, 32, 48]  # 64 x 2 rows > 100
    assert all(bs * (k + 1) <= 100 for bs, k in p.shapes) and (48, 1) in p.shapes and (32, 3) not in p.shapes
    assert plan_verify_graphs(2, 4, 0, 1, 64, 16) is None


def test_plan_picks_the_bucket_with_fewest_padded_rows():
    p = plan_verify_graphs(4, 64, 16, 8192, 1024, 16)
    assert p.bucket(1, 1) == (1, 1)
    assert p.bucket(3, 2) == (4, 2)
    assert p.bucket(5, 4) == (8, 4)
    assert p.bucket(17, 1) is None and p.bucket(2, 5) is None


def test_memory_estimate_counts_outputs_inputs_and_each_graph():
    p = plan_verify_graphs(2, 4, 4, 8192, 64, 16)  # buckets (1, 2, 4) x (1, 2)
    rows = sum(bs * (k + 1) for bs, k in p.shapes)
    assert rows == (1 + 2 + 4) * (2 + 3)
    want = rows * 1024 * 2 + 4 * (4 * 12 + 4 + 4 * 4) + 6 * PER_GRAPH_BYTES
    assert p.memory_bytes(hidden_size=1024, dtype_bytes=2) == want


# --- the padded layout --------------------------------------------------------------------------------------


def test_padded_layout_puts_real_rows_last_and_padding_nowhere(checkpoints):
    """Bucket (4 requests, K=4) for a request verifying 3 drafts and one decoding: each owns 5 rows, real rows
    last at their true positions and slots; padding rows (and the two padding-only requests) write slot -1 at
    position 0; the logits rows are the real ones in plan order; context lengths are the real ones."""
    from shared.engine.sequence import Sequence

    engine = make_engine(checkpoints["llama"], speculative_config=NGRAM)
    plan = plan_verify_graphs(4, 4, 0, 8192, engine.max_model_len, 16)
    graphs = engine.runner.use_verify_graphs(plan, capture=False)
    a = Sequence("a", list(range(100, 120)), greedy(8))  # 20 tokens, 19 computed, 3 drafts: positions 19..22
    a.num_computed_tokens, a.spec_token_ids, a.block_table = 19, [7, 8, 9], [4, 9]  # positions 16-31: block 9
    b = Sequence("b", list(range(200, 209)), greedy(8))  # 9 tokens, 8 computed: one decode row at position 8
    b.num_computed_tokens, b.block_table = 8, [3]
    words = graphs._rows([(a, 4), (b, 1)], [0, 1, 2, 3, 4], 4, 4)
    m = graphs.m
    ids, pos, slots, rows, ctx = (words[:m], words[m : 2 * m], words[2 * m : 3 * m], words[3 * m : 4 * m],
                                  words[4 * m :])
    assert ids[:10] == [0, 119, 7, 8, 9, 0, 0, 0, 0, 208]
    assert pos[:10] == [0, 19, 20, 21, 22, 0, 0, 0, 0, 8]
    assert slots[:10] == [-1, 9 * 16 + 3, 9 * 16 + 4, 9 * 16 + 5, 9 * 16 + 6, -1, -1, -1, -1, 3 * 16 + 8]
    assert all(s == -1 for s in slots[10:]), "padding requests write nowhere"
    assert rows[:5] == [1, 2, 3, 4, 9]
    assert ctx == [23, 9, 1, 1]


# --- the padded path, eagerly -------------------------------------------------------------------------------


def repetitive(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat parts of themselves: the n-gram proposer drafts runs of several lengths."""
    return [p + p[: 4 + i * 3] + p[: 2 + i] for i, p in enumerate(random_prompts(lengths, seed=seed))]


class WriteWatch:
    """Wraps the engine's verify graphs: every staged verify step's KV writes must land in its real slots only."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self.graphs: VerifyGraphs = engine.runner.verify_graphs
        self.shapes: list[tuple[tuple[int, int], list[int]]] = []  # (bucket, each request's tokens) per step
        run = self.graphs.run
        self.graphs.run = lambda plan, rows, shape: self._run(run, plan, rows, shape)

    def _run(self, run, plan, rows, shape):  # noqa: ANN001, ANN202
        bsz = self.engine.config.block_size
        real = {seq.block_table[p // bsz] * bsz + p % bsz
                for seq, n in plan for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)}
        before = [k.clone() for k, _ in self.engine.runner.kv_caches]
        out = run(plan, rows, shape)
        for old, (k, _) in zip(before, self.engine.runner.kv_caches):
            changed = (old != k).flatten(2).any(-1).flatten().nonzero().flatten().tolist()  # slot numbers
            leaked = set(changed) - real
            assert not leaked, f"a padded row wrote KV into slots {sorted(leaked)[:8]} outside the step's own"
        assert torch.isfinite(out).all(), "a real row's hidden state is not finite"
        self.shapes.append((shape, [n for _, n in plan]))
        return out


def run_checked(engine, prompts, params) -> list:  # noqa: ANN001
    """Each prompt's finished output, in order, check_integrity after every step (run_to_completion)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        engine.add_request(rid, p, sp)
    done = run_to_completion(engine)
    return [done[r] for r in ids]


def padded_engine(ckpt, **overrides):  # noqa: ANN001, ANN201
    engine = make_engine(ckpt, speculative_config=NGRAM, **overrides)
    plan = plan_verify_graphs(4, engine.config.max_num_seqs, NGRAM.disable_by_batch_size,
                              engine.config.max_num_batched_tokens, engine.max_model_len, engine.config.block_size)
    engine.runner.use_verify_graphs(plan, capture=False)
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])  # mistral: a sliding window
def test_padded_verify_gives_the_unpadded_tokens(checkpoints, arch):
    """Five requests of different lengths and max_tokens: the batch shrinks 5 -> 1 through buckets 8, 4, 2, 1, and
    each step mixes requests verifying 0 to 4 drafts."""
    ckpt = checkpoints[arch]
    prompts = repetitive([14, 30, 9, 22, 40], seed=21)
    params = [greedy(m, logprobs=None) for m in (28, 12, 20, 6, 16)]
    eager = make_engine(ckpt, speculative_config=NGRAM)
    want = run_checked(eager, prompts, params)
    plain = make_engine(ckpt).generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in want] == [o.output_token_ids for o in plain]
    engine = padded_engine(ckpt)
    watch = WriteWatch(engine)
    got = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    stats = engine.runner.verify_graphs.stats
    assert stats.padded_eager == len(watch.shapes) > 0 and stats.replays == 0
    buckets = {shape[0] for shape, _ in watch.shapes}
    assert len(buckets) >= 3, f"the batch went through request buckets {buckets}"
    assert any(len(set(ns)) > 1 for _, ns in watch.shapes), "some step mixed draft lengths (padded drafts)"
    assert any(shape[0] > len(ns) for shape, ns in watch.shapes), "some step padded requests"
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_all_free(engine)


def test_padded_verify_keeps_sampled_requests_exact(checkpoints):
    """Seeded sampled requests beside greedy ones: the rejection sampler sees the same logits rows, so the
    padded path draws the unpadded path's tokens."""
    ckpt = checkpoints["qwen2"]
    prompts = repetitive([20, 33, 27], seed=9)
    params = [SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=s, logprobs=1) for s in (1, 2)]
    params.append(greedy(14))
    want = run_checked(make_engine(ckpt, speculative_config=NGRAM), prompts, params)
    engine = padded_engine(ckpt)
    WriteWatch(engine)
    got = run_checked(engine, prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    for a, b in zip(got, want):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-5)
    assert engine.runner.verify_graphs.stats.padded_eager > 0
    assert_all_free(engine)


def test_write_watch_catches_a_padding_row_that_writes(checkpoints):
    """The leak check can fail: padding rows given a real slot (a free block's) are caught at the first step."""
    engine = padded_engine(checkpoints["llama"])
    graphs = engine.runner.verify_graphs
    rows = graphs._rows
    victim = (engine.num_blocks - 1) * engine.config.block_size

    def leaky(plan, sample_rows, bs, k):  # noqa: ANN001, ANN202
        words = rows(plan, sample_rows, bs, k)
        m = graphs.m
        return words[: 2 * m] + [victim if s == -1 else s for s in words[2 * m : 3 * m]] + words[3 * m :]

    graphs._rows = leaky
    WriteWatch(engine)
    with pytest.raises(AssertionError, match="padded row wrote KV"):
        run_checked(engine, repetitive([14, 30, 9], seed=21), [greedy(12, logprobs=None)] * 3)


def test_steps_no_bucket_fits_fall_back_to_eager(checkpoints):
    """A verify plan with more requests than any bucket runs the eager path and is counted as such."""
    engine = make_engine(checkpoints["llama"], speculative_config=NGRAM)
    plan = plan_verify_graphs(4, 2, 0, 8192, engine.max_model_len, engine.config.block_size)  # buckets 1 and 2
    engine.runner.use_verify_graphs(plan, capture=False)
    prompts = repetitive([14, 30, 9], seed=21)
    want = make_engine(checkpoints["llama"]).generate(prompts, greedy(16, logprobs=None), use_tqdm=False)
    got = run_checked(engine, prompts, [greedy(16, logprobs=None)] * 3)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    stats = engine.runner.verify_graphs.stats
    assert stats.eager > 0 and stats.padded_eager > 0, stats


def test_padded_verify_through_preemption_prefix_hits_and_an_abort(checkpoints):
    """A pool too small for three growing requests (preemption, drafts included), the same prompts again (prefix
    hits), then an abort midway: the padded path gives the unpadded tokens and frees everything."""
    ckpt = checkpoints["mistral"]
    prompts = repetitive([16, 9, 20], seed=7)
    params = greedy(20, logprobs=None)
    want = make_engine(ckpt, num_kv_blocks=9).generate(prompts, params, use_tqdm=False)
    engine = padded_engine(ckpt, num_kv_blocks=9)
    WriteWatch(engine)
    for _ in range(2):
        got = run_checked(engine, prompts, [params] * 3)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert engine.scheduler.num_preemptions > 0 and any(o.num_cached_tokens for o in got)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params)
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    engine.abort("a1")
    done = run_to_completion(engine)
    assert [done["a0"].output_token_ids, done["a2"].output_token_ids] == [want[0].output_token_ids,
                                                                          want[2].output_token_ids]
    assert engine.runner.verify_stats.padded_eager > 0
    assert_all_free(engine)
