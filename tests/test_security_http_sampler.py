"""A request's sampler inputs cost each step what changed, not its whole context: penalties absorb only the
tokens appended since the previous step, logit_bias and allowed_token_ids become tensors once per request. The
result equals a from-scratch computation at every step, speculative verify positions included."""
from __future__ import annotations

import torch

from shared.engine.sampler import Sampler, apply_penalties
from shared.engine.sequence import Sequence
from shared.engine.spec.draft_position import positions
from shared.sampling_params import SamplingParams

VOCAB = 4096


def test_penalties_absorb_only_new_tokens_and_match_a_fresh_computation() -> None:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (50_000,), generator=g).tolist()  # a long context, judged once
    seq = Sequence("long", prompt, SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2))
    plain = Sequence("plain", [1, 2, 3], SamplingParams())
    sampler = Sampler((0,))
    first_rows = None
    for step in range(20):
        logits = torch.randn(2, VOCAB, generator=g)
        want = logits.clone()
        apply_penalties(want, [seq, plain])  # from scratch
        sampler.process_logits(logits, [seq, plain])
        assert torch.equal(logits, want), step
        state = sampler.states._states[seq]
        assert state.upto == seq.num_tokens  # everything absorbed, nothing more
        if first_rows is None:
            first_rows = (state.seen, state.counts)
        assert state.seen is first_rows[0] and state.counts is first_rows[1]  # updated in place, never rebuilt
        seq.token_ids.append(int(torch.randint(0, VOCAB, (1,), generator=g)))
    # A verify position sees its drafts without writing them into the sequence's own rows.
    seq.spec_token_ids = [5, 5, 7]
    views = positions(seq, 3)
    logits = torch.randn(len(views), VOCAB, generator=g)
    want = logits.clone()
    apply_penalties(want, views)
    sampler.process_logits(logits, views)
    assert torch.equal(logits, want)
    assert sampler.states._states[seq].upto == seq.num_tokens


def test_logit_bias_and_allowed_ids_are_built_once_per_request() -> None:
    allowed = list(range(0, VOCAB, 3))
    seq = Sequence("b", [1, 2], SamplingParams(logit_bias={i: 1.0 for i in range(300)}, allowed_token_ids=allowed))
    sampler = Sampler((0,))
    built = None
    for _ in range(5):
        logits = torch.zeros(1, VOCAB)
        sampler.process_logits(logits, [seq])
        assert torch.isinf(logits[0, 1]) and logits[0, 0] == 1.0 and logits[0, 3] == 1.0 and logits[0, 303] == 0.0
        state = sampler.states._states[seq]
        if built is None:
            built = (state.bias[0], state.allowed)
        assert state.bias[0] is built[0] and state.allowed is built[1]
        seq.token_ids.append(3)
