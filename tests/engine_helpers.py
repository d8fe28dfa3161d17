"""Shared helpers for engine tests: building engines on test checkpoints and checking against transformers."""
from __future__ import annotations

import torch

from shared.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.sampling_params import SamplingParams
from tests.checkpoints import VOCAB, Checkpoint

LOGPROB_TOL = 1e-4


def make_engine(ckpt: Checkpoint, **overrides) -> LLMEngine:
    cfg = dict(model=str(ckpt.path), num_kv_blocks=256, max_num_batched_tokens=512, max_num_seqs=64)
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB - 1) -> list[list[int]]:
    # vocab - 1: keep the eos id out of prompts so they read like real ones.
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int, logprobs: int | None = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs)


def assert_matches_hf(ckpt: Checkpoint, reference, prompts, outputs: list[RequestOutput], max_tokens: int,
                      check_logprobs: bool = True) -> None:
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref_tokens, ref_logprobs = reference(ckpt, prompt, max_tokens)
        assert out.output_token_ids == ref_tokens, f"{ckpt.arch} prompt {i} (len {len(prompt)}) differs from transformers"
        assert out.finish_reason == ("stop" if len(ref_tokens) < max_tokens else "length")
        if check_logprobs:
            assert out.logprobs is not None and len(out.logprobs) == len(ref_tokens)
            for step, lp in enumerate(out.logprobs):
                ref_top = ref_logprobs[step].topk(len(lp.top)).values
                ours = torch.tensor([v for _, v in lp.top])
                err = (ours - ref_top).abs().max().item()
                assert err <= LOGPROB_TOL, f"{ckpt.arch} prompt {i} step {step}: top logprobs off by {err}"
                assert abs(lp.logprob - ref_logprobs[step][lp.token_id].item()) <= LOGPROB_TOL


def assert_all_free(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert all(r == 0 for r in bm.ref_counts)


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return done
