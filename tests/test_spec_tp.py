"""Speculative decoding on a tensor-parallel engine: the verify step (several query tokens a sequence, rejected
drafts' slots trimmed) is broadcast to the follower ranks like any other step, so greedy output with speculation
at TP=2 is TP=1's without it, drafts are accepted, and nothing is left allocated."""
from __future__ import annotations

from shared.spec_config import SpeculativeConfig
from tests.engine_helpers import assert_all_free, greedy, make_engine, random_prompts

MAX_NEW = 24


def test_ngram_speculation_at_tp2_equals_tp1_without_it(checkpoints):
    ckpt = checkpoints["llama"]
    prompts = [p + p[:12] + p[:12] for p in random_prompts([5, 17, 40], seed=2)]
    reference = make_engine(ckpt).generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    engine = make_engine(ckpt, tensor_parallel_size=2, speculative_config=spec)
    try:
        ours = engine.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        assert [o.output_token_ids for o in ours] == [o.output_token_ids for o in reference]
        assert engine.speculator.stats.num_accepted_tokens > 0, "nothing was accepted: the test shows nothing"
        assert_all_free(engine)
    finally:
        engine.shutdown()
