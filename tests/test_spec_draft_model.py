"""Draft-model speculation (shared/engine/spec/draft_model.py, draft_kv.py): greedy output identical token for token
to decoding without speculation (and to transformers) with a smaller draft of the same vocabulary and with the
target drafting for itself (acceptance near 100%), in mixed batches with chunked prefill, preemption, prefix hits,
aborts, stops and max_tokens inside an accepted run; the draft's KV blocks are freed with each request; sampled
requests keep the target's distribution with the draft's real q (chi-square on a tiny vocabulary)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.errors import ConfigError
from shared.engine.spec.draft_kv import DraftKV
from shared.engine.sequence import Sequence
from shared.sampling_params import SamplingParams
from shared.spec_config import SpeculativeConfig
from tests.checkpoints import ARCHS, build_checkpoint
from tests.engine_helpers import assert_all_free, assert_matches_hf, greedy, make_engine, run_to_completion
from tests.test_spec_decode import (MAX_NEW, all_cached_hashes_are_real, check_mixed_batch, repetitive_prompts,
                                    run_to_completion_outputs)

CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, Path]:
    """Per architecture a one-layer draft (other weights, same vocabulary and tokenizer) of the test checkpoints."""
    root = tmp_path_factory.mktemp("drafts")
    return {a: build_checkpoint(a, root / a, seed=1, num_hidden_layers=1, intermediate_size=64).path for a in ARCHS}


def draft_config(path: Path, k: int = 4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k, **kw)


def assert_draft_pool_free(engine) -> None:  # noqa: ANN001
    kv = engine.speculator.proposer.kv
    assert not kv.shadows and kv.num_free_blocks == kv.num_blocks, "draft KV blocks leaked"


def stepped(engine, prompts, params, ids=None):  # noqa: ANN001, ANN201
    """Run to completion with check_integrity (the draft pool's too) after every step; outputs in order, events."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    events, done = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        events += engine.block_manager.drain_events()
    return [done[r] for r in ids], events


# --- the flag and the start-up checks -----------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ('{"method": "draft_model"}', 'needs "model"'),
    ('{"method": "draft_model", "model": ""}', 'needs "model"'),
    ('{"method": "ngram", "model": "x"}', '"model" is only for method "draft_model"'),
])
def test_bad_draft_model_config_is_a_clear_error(text, message):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.parse(text)
    assert message in str(e.value)


def test_kvmesh_up_hands_decode_workers_an_absolute_draft_path(tmp_path, monkeypatch):
    from shared.launcher.up import _speculative_config

    (tmp_path / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    text = _speculative_config('{"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}')
    spec = SpeculativeConfig.parse(text)
    assert spec.model == str(tmp_path / "draft") and spec.num_speculative_tokens == 3


def test_draft_with_another_vocabulary_is_refused_at_start(checkpoints, tmp_path):
    other = build_checkpoint("llama", tmp_path / "v256", vocab_size=256)
    with pytest.raises(ConfigError, match="vocabulary has 256 entries, the target's 512"):
        make_engine(checkpoints["llama"], speculative_config=draft_config(other.path))
    with pytest.raises(ConfigError, match="cannot load the draft model"):
        make_engine(checkpoints["llama"], speculative_config=draft_config(tmp_path / "missing"))


def test_draft_kv_rolls_back_to_the_accepted_prefix_and_frees():
    kv = DraftKV(num_blocks=3, block_size=4)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    shadow = kv.sync(seq, extra=3)  # 5 context + 3 drafts' KV: 2 blocks
    assert shadow.num_computed_tokens == 0 and len(shadow.block_table) == 2
    shadow.token_ids += [6, 7, 8, 9]  # drafted 6 7 8 9, KV computed through 8
    shadow.num_computed_tokens = 8
    seq.token_ids += [6, 7, 0]  # the verify kept 6 7 and corrected 8 to 0
    shadow = kv.sync(seq, extra=3)
    assert shadow.num_computed_tokens == 7 and shadow.token_ids == seq.token_ids
    other = Sequence("b", list(range(9)), SamplingParams(max_tokens=4))
    assert kv.sync(other, extra=3) is None, "the pool is full: no drafts, nothing taken"
    kv.check_integrity({"a"})
    kv.retain({"b"})  # "a" is no longer running (preempted, finished, aborted): its blocks come back
    assert kv.num_free_blocks == 3 and not kv.shadows


# --- greedy exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_no_speculation_and_transformers(arch, checkpoints, drafts, hf_reference):
    """Mixed batch under a small token budget (prompt chunks beside verifies): a one-layer draft (acceptance near
    0 for random weights: every verify rolls the draft back) and the target as its own draft (near 100%)."""
    ckpt = checkpoints[arch]
    prompts = repetitive_prompts([3, 17, 60], seed=11)
    plain = make_engine(ckpt, max_num_batched_tokens=48).generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    # The target as its own draft on two architectures (the other tests use it too): the default suite stays short.
    for draft in (drafts[arch], ckpt.path) if arch in ("llama", "qwen3") else (drafts[arch],):
        engine = make_engine(ckpt, max_num_batched_tokens=48, speculative_config=draft_config(draft))
        outputs, events = stepped(engine, prompts, greedy(MAX_NEW))
        assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in plain], draft
        assert_matches_hf(ckpt, hf_reference, prompts, outputs, MAX_NEW)  # logprobs are the target's
        all_cached_hashes_are_real(engine, [p + o.output_token_ids for p, o in zip(prompts, outputs)], events)
        stats = engine.speculator.stats
        assert stats.num_drafts > 0
        if draft == ckpt.path:
            rate = stats.num_accepted_tokens / stats.num_draft_tokens
            assert rate > 0.9, f"{arch}: the target drafting for itself accepted only {rate:.2f} ({stats})"
        assert_all_free(engine)
        assert_draft_pool_free(engine)


def test_stop_id_and_max_tokens_inside_an_accepted_run(checkpoints):
    ckpt = checkpoints["qwen3"]
    prompt = repetitive_prompts([30], seed=5)[0]
    plain = make_engine(ckpt)
    out = plain.generate([prompt], greedy(MAX_NEW, logprobs=None), use_tqdm=False)[0].output_token_ids
    spec = make_engine(ckpt, speculative_config=draft_config(ckpt.path))
    spec.add_request("probe", prompt, greedy(MAX_NEW, logprobs=None))
    chunks = [list(o.new_token_ids) for o in run_to_completion_outputs(spec)]
    assert max(len(c) for c in chunks) == 5, "the target drafting for itself: whole runs accepted"
    at, inside = 0, []
    for c in chunks:  # tokens inside an accepted run, at their first occurrence in the output
        inside += [at + j for j in range(len(c) - 1) if out.index(c[j]) == at + j]
        at += len(c)
    assert inside
    j = inside[-1]
    for params in (SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[out[j]], logprobs=1),
                   SamplingParams(max_tokens=j + 1, temperature=0.0, logprobs=1)):
        a = plain.generate([prompt], params, use_tqdm=False)[0]
        b = spec.generate([prompt], params, use_tqdm=False)[0]
        assert b.output_token_ids == a.output_token_ids == out[: j + 1]
        assert b.finish_reason == a.finish_reason
        assert [lp.token_id for lp in b.logprobs] == out[: j + 1]
    assert_all_free(spec)
    assert_draft_pool_free(spec)


def test_preemption_prefix_hits_and_aborts(checkpoints):
    ckpt = checkpoints["mistral"]
    prompts = repetitive_prompts([16, 9, 20], seed=7)
    params = greedy(24, logprobs=None)
    want = make_engine(ckpt, num_kv_blocks=9).generate(prompts, params, use_tqdm=False)
    spec = make_engine(ckpt, num_kv_blocks=9, speculative_config=draft_config(ckpt.path))
    got, _ = stepped(spec, prompts, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert spec.scheduler.num_preemptions > 0
    assert_draft_pool_free(spec)
    again, _ = stepped(spec, prompts, params, ids=["b0", "b1", "b2"])  # prefix hits: the draft recomputes its own
    assert any(o.num_cached_tokens for o in again)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in want]
    for i, p in enumerate(prompts):
        spec.add_request(f"a{i}", p, params)
    for _ in range(5):
        spec.step()
        spec.check_integrity()
    assert "a1" in spec.speculator.proposer.kv.shadows or spec.scheduler.num_preemptions
    spec.abort("a1")
    spec.check_integrity()
    assert "a1" not in spec.speculator.proposer.kv.shadows, "an aborted request's draft KV is freed at once"
    done = run_to_completion(spec)
    assert set(done) == {"a0", "a2"}
    assert [done["a0"].output_token_ids, done["a2"].output_token_ids] == [want[0].output_token_ids,
                                                                          want[2].output_token_ids]
    assert spec.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec)
    assert_draft_pool_free(spec)


def test_sampled_and_greedy_requests_in_one_batch(checkpoints, drafts):
    """Seeded sampled requests (drafts drawn from the draft's q) repeat run after run; greedy ones beside them,
    one with logit_bias and a repetition penalty, equal decoding without speculation."""
    def drafted_and_freed(engine) -> None:  # noqa: ANN001
        assert engine.speculator.stats.num_drafts > 0
        assert_draft_pool_free(engine)

    check_mixed_batch(checkpoints["qwen2"], draft_config(drafts["qwen2"]), drafted_and_freed)


# --- sampling stays exact with the draft's real distribution -----------------------------------------------


def tiny_vocab_pair(tmp_path: Path):  # noqa: ANN201
    vocab = 8
    target = build_checkpoint("llama", tmp_path / "t", vocab_size=vocab, eos_token_id=vocab - 1, num_hidden_layers=3,
                              initializer_range=0.5)
    draft = build_checkpoint("llama", tmp_path / "d", seed=3, vocab_size=vocab, eos_token_id=vocab - 1,
                             initializer_range=0.5)
    return target, draft


def test_sampled_tokens_follow_the_target_with_a_draft_models_q(tmp_path):
    """Target and draft of an 8-token vocabulary, different weights: 1200 requests decode 3 tokens with temperature
    and top-k; the 2nd comes out of a verify step (a draft drawn from q, accepted with min(1, p/q) or resampled from
    max(p - q, 0)). Its counts, given the most frequent first token, follow the target's processed distribution
    computed from transformers' logits."""
    target, draft = tiny_vocab_pair(tmp_path)
    params = SamplingParams(max_tokens=3, temperature=0.9, top_k=6, ignore_eos=True)
    n = 1200
    engine = make_engine(target, num_kv_blocks=n + 16, max_num_seqs=n, max_num_batched_tokens=8 * n, seed=1,
                         speculative_config=draft_config(draft.path, k=2, disable_by_batch_size=0))
    prompt = [1, 4, 2, 5]
    outs = engine.generate([prompt] * n, params, use_tqdm=False)
    stats = engine.speculator.stats
    assert stats.num_drafts == n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert_all_free(engine)
    assert_draft_pool_free(engine)
    firsts = [o.output_token_ids[0] for o in outs]
    first = max(set(firsts), key=firsts.count)
    counts = torch.bincount(torch.tensor([o.output_token_ids[1] for o in outs if o.output_token_ids[0] == first]),
                            minlength=8).float()
    with torch.no_grad():
        logits = target.hf_model(torch.tensor([prompt + [first]])).logits[0, -1].float() / params.temperature
    p = logits.masked_fill(logits < logits.topk(params.top_k).values[-1], float("-inf")).softmax(-1)
    keep = p > 0
    assert counts[~keep].sum() == 0, "a token top-k removed was emitted"
    expected = p[keep] * counts.sum()
    stat, df = float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1
    assert stat < CHI2_999[df], f"2nd token after {first} ({int(counts.sum())} samples): chi2 {stat:.1f}"


def test_sampled_drafts_are_verified_against_the_drafts_q(tmp_path):
    """The target drafting for itself at temperature 1: with its real q (= p) every draft is accepted; verified as
    a point mass it would be accepted with probability p(d) only (sum of p^2, about 0.4 here)."""
    target, _ = tiny_vocab_pair(tmp_path)
    n = 200
    engine = make_engine(target, num_kv_blocks=2 * n, max_num_seqs=n, max_num_batched_tokens=8 * n,
                         speculative_config=draft_config(target.path, k=3, disable_by_batch_size=0))
    engine.generate([[1, 4, 2, 5]] * n, SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),
                    use_tqdm=False)
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0.95 * stats.num_draft_tokens, stats
    assert_all_free(engine)
    assert_draft_pool_free(engine)


# --- the real model ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_greedy_equals_no_speculation(smollm2_dir, tmp_path):
    """SmolLM2 drafted by its own first 24 of 30 layers (loadtest/draft_checkpoint.py; fewer layers draft nothing the
    target accepts): same tokens, the target's logprobs, some drafts accepted."""
    from loadtest.draft_checkpoint import truncated_checkpoint
    from shared.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.models.tokenizer import encode_chat, load_tokenizer

    draft = truncated_checkpoint(smollm2_dir, tmp_path / "smollm2-24l", 24)
    tok = load_tokenizer(smollm2_dir)
    text = "The committee met on Tuesday to review the budget and agreed that the library budget would rise."
    prompts = [encode_chat(tok, [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}])]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    cfg = dict(model=str(smollm2_dir), num_kv_blocks=128, max_num_batched_tokens=512, dtype="float32")
    plain = LLMEngine(EngineConfig(**cfg)).generate(prompts, params, use_tqdm=False)
    engine = LLMEngine(EngineConfig(**cfg, speculative_config=draft_config(draft)))
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    for a, b in zip(plain, outs):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-3
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_all_free(engine)
    assert_draft_pool_free(engine)


# --- the draft's forwards: bounded catch-up, the decode-graph path, the memory profile -------------------------


def test_draft_catch_up_and_one_token_steps_through_the_decode_graph_path(checkpoints, drafts):
    """Under a 16-token budget no draft forward computes more than 16 tokens (a new prompt is caught up in chunks),
    and the draft's one-token steps run the padded decode-graph path (eagerly here): the same greedy tokens."""
    ckpt = checkpoints["qwen3"]
    prompts = repetitive_prompts([20, 35, 9], seed=4)
    plain = make_engine(ckpt, max_num_batched_tokens=16).generate(prompts, greedy(16), use_tqdm=False)
    engine = make_engine(ckpt, max_num_batched_tokens=16, speculative_config=draft_config(ckpt.path))
    draft = engine.speculator.proposer.draft
    draft.use_decode_graphs(capture=False)
    sizes, graph_steps = [], []
    runner = draft.runner
    real_rows, real_run = runner.execute_rows, runner.graphs.run
    runner.execute_rows = lambda plan, *a: sizes.append(sum(n for _, n in plan)) or real_rows(plan, *a)
    runner.graphs.run = lambda plan: graph_steps.append(len(plan)) or real_run(plan)
    outputs, _ = stepped(engine, prompts, greedy(16))
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in plain]
    assert max(sizes) <= 16 and graph_steps, (max(sizes), len(graph_steps))
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_all_free(engine)
    assert_draft_pool_free(engine)


def test_profile_measures_the_draft_forward(monkeypatch, checkpoints, drafts):
    """profile_draft: a max_num_batched_tokens forward with max_num_seqs float rows, on a temporary draft pool."""
    from shared.engine.profile_run import profile_draft
    from tests.test_memory_budget import FakeMemory

    engine = make_engine(checkpoints["llama"], speculative_config=draft_config(drafts["llama"]))
    draft = engine.speculator.proposer.draft
    runner = draft.runner
    caches = runner.kv_caches
    assert profile_draft(runner, draft.kv_dtype, 48, 8, 40) == 0 and runner.kv_caches is caches  # off CUDA
    mem = FakeMemory(start=1000)
    act = 20 << 20
    seen = []
    real = runner.execute_rows

    def execute_rows(plan, rows, hidden_rows):  # noqa: ANN001, ANN202
        seen.append((sum(n for _, n in plan), len(rows)))
        a = mem.track(torch.empty(act, dtype=torch.uint8))
        out = real(plan, rows, hidden_rows)
        logits = mem.track(out[0])  # made while the activations live
        del a
        return logits, out[1]

    import shared.engine.model_runner as mr

    real_alloc = mr.allocate_kv_cache

    def alloc(*a, **kw):  # noqa: ANN002, ANN003, ANN202 - the temporary pool counts as allocated memory
        caches = real_alloc(*a, **kw)
        for layer in caches:
            for t in layer:
                mem.track(t)
        return caches

    monkeypatch.setattr(mr, "allocate_kv_cache", alloc)
    monkeypatch.setattr(runner, "execute_rows", execute_rows)
    peak = profile_draft(runner, draft.kv_dtype, 48, 8, 40, memory=mem)
    assert seen == [(48, 8)]
    assert peak == act + 8 * engine.model_config.vocab_size * 4
    assert runner.kv_caches is caches


def test_graph_reserve_counts_the_verify_and_draft_graphs(checkpoints, drafts):
    from shared.engine.kv_pool_size import graph_reserve
    from shared.engine.memory_budget import CUDA_GRAPH_RESERVE
    from shared.engine.verify_buckets import decode_graph_bytes, verify_plan_for

    engine = make_engine(checkpoints["llama"], speculative_config=draft_config(drafts["llama"]))
    c, draft = engine.config, engine.speculator.proposer.draft
    verify = verify_plan_for(c, engine.max_model_len).memory_bytes(engine.model_config.hidden_size, 4)
    assert graph_reserve(c, engine.runner, engine.max_model_len, None) == CUDA_GRAPH_RESERVE + verify
    assert graph_reserve(c, engine.runner, engine.max_model_len, draft) == (
        CUDA_GRAPH_RESERVE + verify + decode_graph_bytes(c.max_num_seqs, draft.config.hidden_size, 4))
