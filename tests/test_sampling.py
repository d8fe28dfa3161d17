"""Sampling: seeded batch invariance, stop conditions, penalties, filters, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from shared.engine.sampler import apply_penalties, filter_logits
from shared.sampling_params import SamplingParams
from shared.engine.sequence import Sequence
from tests.checkpoints import EOS
from tests.engine_helpers import assert_all_free, make_engine, random_prompts, run_to_completion


def test_seeded_request_is_identical_alone_and_in_a_batch_of_32(checkpoints):
    ckpt = checkpoints["llama"]
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    prompt = random_prompts([21], seed=7)[0]
    alone = make_engine(ckpt).generate([prompt], params, use_tqdm=False)[0].output_token_ids

    engine = make_engine(ckpt, max_num_batched_tokens=64)
    others = random_prompts([5 + 3 * i for i in range(32)], seed=8)
    for i, p in enumerate(others):  # a mix of seeded, unseeded, greedy and penalised neighbours
        engine.add_request(f"o{i}", p, SamplingParams(max_tokens=30, temperature=0.7 if i % 3 else 0.0,
                                                       seed=i if i % 2 else None, presence_penalty=0.5 * (i % 2)))
    engine.step()
    engine.add_request("target", prompt, params)
    done = run_to_completion(engine)
    assert done["target"].output_token_ids == alone
    assert_all_free(engine)


def test_different_seeds_differ_and_same_seed_repeats(checkpoints):
    engine = make_engine(checkpoints["qwen2"])
    prompt = random_prompts([10], seed=9)[0]
    outs = engine.generate([prompt] * 3, [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in (1, 1, 2)],
                           use_tqdm=False)
    assert outs[0].output_token_ids == outs[1].output_token_ids != outs[2].output_token_ids


def test_stop_token_ids_min_tokens_max_tokens_ignore_eos(checkpoints):
    engine = make_engine(checkpoints["llama"])
    prompt = random_prompts([12], seed=10)[0]
    free_run = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)[0].output_token_ids
    assert len(free_run) == 20
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at],
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.output_token_ids == free_run[: first + 1]
    out = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_at],
                                                   min_tokens=first + 2, ignore_eos=True), use_tqdm=False)[0]
    assert stop_at not in out.output_token_ids[: first + 2] and len(out.output_token_ids) >= first + 2
    out = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason in ("length", "stop") and len(out.output_token_ids) <= 3
    assert_all_free(engine)


def test_eos_from_generation_config_stops_unless_ignored(checkpoints, tmp_path):
    import json
    import shutil

    ckpt = checkpoints["llama"]
    prompt = random_prompts([12], seed=10)[0]
    free_run = make_engine(ckpt).generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                          use_tqdm=False)[0].output_token_ids
    eos = free_run[3]
    model_dir = tmp_path / "ckpt"
    shutil.copytree(ckpt.path, model_dir)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = [eos, EOS]
    gen_path.write_text(json.dumps(gen))
    engine = make_engine(ckpt, model=str(model_dir))
    assert set(engine.model_config.eos_token_ids) == {eos, EOS}
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.output_token_ids == free_run[: free_run.index(eos) + 1]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.output_token_ids == free_run


def test_logprobs_up_to_20_and_validation(checkpoints):
    engine = make_engine(checkpoints["qwen3"])
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.8, seed=3, logprobs=20),
                          use_tqdm=False)[0]
    for lp, tok in zip(out.logprobs, out.output_token_ids):
        assert lp.token_id == tok and len(lp.top) == 20
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and lp.logprob <= vals[0] + 1e-6
        assert math.isclose(sum(math.exp(v) for v in vals), sum(math.exp(v) for v in vals[:20]))
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(min_tokens=5, max_tokens=2),
                dict(presence_penalty=3), dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _kept(logits: torch.Tensor, **kw) -> list[bool]:
    out = logits.clone().unsqueeze(0)
    filter_logits(out, [SamplingParams(**kw)])
    return (~torch.isinf(out[0])).tolist()


def test_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert _kept(logits, top_k=2) == [True, True, False, False, False]
    p = logits.softmax(-1)  # ~[0.64, 0.24, 0.09, 0.03, 0.01]
    assert _kept(logits, top_p=0.8) == [True, True, False, False, False]
    assert _kept(logits, top_p=1e-9) == [True, False, False, False, False], "top_p keeps at least the top token"
    assert _kept(logits, min_p=0.1) == (p >= 0.1 * p.max()).tolist()
    assert _kept(torch.tensor([4.0, 3.0, 3.0, 1.0]), top_k=2) == [True, True, True, False], "ties with the k-th stay"


def test_penalties():
    s = Sequence("x", [0, 1], SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5))
    s.token_ids += [2, 2]  # outputs
    plain = Sequence("y", [0, 1, 2], SamplingParams())
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0], [2.0, -2.0, 1.0, 1.0]])
    apply_penalties(logits, [s, plain])
    # rep: 0 -> 1.0, 1 -> -4.0, 2 -> 0.5; presence+frequency on 2 (twice): 0.5 - 1 - 1 = -1.5
    assert logits.tolist() == [[1.0, -4.0, -1.5, 1.0], [2.0, -2.0, 1.0, 1.0]]


def test_priority_orders_admission(checkpoints):
    engine = make_engine(checkpoints["llama"], max_num_seqs=1)
    for rid, prio in (("low", 0), ("high", 5), ("low2", 0), ("mid", 2)):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), priority=prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low", "low2"]


def test_bad_requests_are_rejected_without_side_effects(checkpoints):
    engine = make_engine(checkpoints["llama"], num_kv_blocks=8)
    for prompt, params, msg in (
        ([], SamplingParams(), "at least one token"),
        ([1, 99999], SamplingParams(), "outside the vocabulary"),
        ([1] * 600, SamplingParams(), "context"),
        ([1] * 100, SamplingParams(max_tokens=100), "KV blocks"),
    ):
        with pytest.raises(ValueError, match=msg):
            engine.add_request("bad", prompt, params)
    engine.add_request("ok", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2], SamplingParams(max_tokens=2))
    run_to_completion(engine)
    assert_all_free(engine)


def test_token_ids_named_by_sampling_are_checked_against_the_vocabulary(checkpoints):
    """An out-of-vocabulary stop id once crashed the engine thread inside the sampler; now it is a clean 400."""
    engine = make_engine(checkpoints["llama"])
    for bad in (dict(stop_token_ids=[10**9]), dict(logit_bias={10**6: 1.0}), dict(allowed_token_ids=[1, -1])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("bad", [1, 2, 3], SamplingParams(**bad))
    assert not engine.has_unfinished_requests()
    assert_all_free(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prompt_logprobs_over_chunked_prefill_match_transformers(checkpoints, arch):
    """Chunks of 16 tokens: every prompt position's logits are kept, across chunk boundaries, and a cached
    prefix is not used (its positions would have no logits)."""
    ckpt = checkpoints[arch]
    engine = make_engine(ckpt, max_num_batched_tokens=16)
    prompt = random_prompts([45], seed=9)[0]
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # warms the cache
    out = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(ckpt.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        lp = out.prompt_logprobs[i]
        assert lp.token_id == prompt[i] and lp.logprob == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[i - 1].topk(3).indices.tolist()
    one = engine.generate([[7]], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def test_bad_words_are_never_completed(checkpoints):
    """vLLM's bad_words in the engine: a one-token word never appears; a two-token word's second token is
    masked only right after its first (so the first alone may still be written)."""
    engine = make_engine(checkpoints["llama"])
    prompt = random_prompts([12], seed=21)[0]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = engine.generate([prompt], greedy, use_tqdm=False)[0].output_token_ids
    one = [base[3]]
    two = base[5:7]
    out = engine.generate([prompt], greedy.model_copy(update={"bad_words_ids": [one, two]}),
                          use_tqdm=False)[0].output_token_ids
    assert one[0] not in out
    assert not any(out[i:i + 2] == two for i in range(len(out) - 1))
    assert out[:3] == base[:3] and out != base  # unchanged up to the first banned token
    # Batched with unconstrained neighbours: the same tokens, and the neighbours unaffected.
    outs = engine.generate([prompt, prompt], [greedy.model_copy(update={"bad_words_ids": [one, two]}), greedy],
                           use_tqdm=False)
    assert outs[0].output_token_ids == out and outs[1].output_token_ids == base
    with pytest.raises(ValueError, match="bad_words_ids"):
        SamplingParams(bad_words_ids=[[]])
