"""The batched device sampler against the per-row reference it replaced, feature by feature."""
from __future__ import annotations

import pytest
import torch

from shared.engine.sampler import Sampler
from shared.sampling_params import SamplingParams
from shared.engine.sequence import Sequence
from tests.sampler_reference import ReferenceSampler

VOCAB = 300
EOS = (7,)


def _seq(i: int, params: SamplingParams, outputs: int = 3) -> Sequence:
    g = torch.Generator().manual_seed(100 + i)
    prompt = torch.randint(0, VOCAB, (5 + i % 7,), generator=g).tolist()
    s = Sequence(f"r{i}", prompt, params)
    s.token_ids += torch.randint(0, VOCAB, (outputs,), generator=g).tolist()
    return s


def _reference(logits: torch.Tensor, seqs: list[Sequence]):
    """Per-row reference; seeded rows get their own CPU generator as the reference expects."""
    for s in seqs:
        if s.params.seed is not None:
            s.generator = torch.Generator().manual_seed(s.params.seed)
    out = ReferenceSampler(EOS).sample(logits.clone(), seqs)
    for s in seqs:
        s.generator = None
    return out


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


DETERMINISTIC = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(temperature=0.0, min_tokens=10, stop_token_ids=[3, 4], max_tokens=20),
    SamplingParams(temperature=0.0, logprobs=5),
    SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=0.8),
]


def test_greedy_and_penalties_match_the_reference_row_for_row():
    seqs = [_seq(i, p) for i, p in enumerate(DETERMINISTIC * 3)]
    logits = _logits(len(seqs))
    # The reference's argmax per row must already agree; make the sampled column unambiguous anyway.
    got = Sampler(EOS).sample(logits.clone(), seqs)
    want = _reference(logits, seqs)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, EOS[0]] = 10.0
    logits[:, 3] = 9.0
    logits[:, 11] = 8.0
    under = _seq(0, SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[3], max_tokens=9), outputs=2)
    ignore = _seq(1, SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True, max_tokens=9), outputs=2)
    assert [t for t, _ in Sampler(EOS).sample(logits, [under, ignore])] == [11, EOS[0]]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, seed=5),
    SamplingParams(temperature=1.2, top_k=20, seed=6),
    SamplingParams(temperature=0.9, top_p=0.8, seed=7),
    SamplingParams(temperature=1.0, min_p=0.05, seed=8),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                   presence_penalty=0.5, frequency_penalty=0.3, seed=9, logprobs=3),
])
def test_seeded_sampling_matches_the_reference_and_ignores_the_batch(params):
    """A seeded row draws the reference's noise (same generator stream), whatever its neighbours."""
    target = _seq(0, params)
    logits = _logits(1, seed=42)
    want = [_reference(logits, [target])[0][0] for _ in range(1)]
    neighbours = [_seq(i, p) for i, p in enumerate(DETERMINISTIC + [SamplingParams(temperature=1.0),
                                                                   SamplingParams(temperature=0.5, seed=77, top_k=3)], 1)]
    batch = neighbours[:4] + [target] + neighbours[4:]
    big = torch.cat([_logits(4, seed=1), logits, _logits(len(neighbours) - 4, seed=2)])
    got = Sampler(EOS).sample(big, batch)
    assert got[4][0] == want[0]
    alone = Sampler(EOS, seed=999).sample(logits.clone(), [_seq(0, params)])
    assert alone[0][0] == want[0]


def test_seeded_stream_over_many_steps_is_batch_independent():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=50)
    a, b = _seq(0, params), _seq(0, params)
    sampler_a, sampler_b = Sampler(EOS), Sampler(EOS, seed=3)
    for step in range(10):
        logits = _logits(1, seed=step)
        ta = sampler_a.sample(logits.clone(), [a])[0][0]
        others = [_seq(i, SamplingParams(temperature=1.0)) for i in range(1, 8)]
        tb = sampler_b.sample(torch.cat([_logits(7, seed=50 + step), logits]), others + [b])[-1][0]
        assert ta == tb
        a.token_ids.append(ta)
        b.token_ids.append(tb)


def test_skip_draw_advances_exactly_one_sample():
    params = SamplingParams(temperature=1.0, seed=21)
    logits = [_logits(1, seed=s) for s in range(3)]
    full, skipped = _seq(0, params), _seq(0, params)
    sampler = Sampler(EOS)
    tokens = [sampler.sample(l.clone(), [full])[0][0] for l in logits]
    sampler.skip_draw(skipped, VOCAB)
    assert [sampler.sample(l.clone(), [skipped])[0][0] for l in logits[1:]] == tokens[1:]


def test_logit_bias_and_allowed_token_ids():
    logits = _logits(3)
    forced = _seq(0, SamplingParams(temperature=0.0, logit_bias={17: 100.0}))
    banned_top = int(logits[1].argmax())
    banned = _seq(1, SamplingParams(temperature=0.0, logit_bias={banned_top: -100.0}))
    allowed = _seq(2, SamplingParams(temperature=1.0, allowed_token_ids=[5, 9], seed=3))
    for _ in range(5):
        got = [t for t, _ in Sampler(EOS).sample(logits.clone(), [forced, banned, allowed])]
        assert got[0] == 17 and got[1] != banned_top and got[2] in (5, 9)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_logprobs_are_of_the_raw_distribution_and_come_back_in_one_pack():
    params = [SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=3.0),
              SamplingParams(temperature=0.0, logprobs=None), SamplingParams(temperature=0.0, logprobs=0)]
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    logits = _logits(3)
    raw = torch.log_softmax(logits, -1)
    got = Sampler(EOS).sample(logits.clone(), seqs)
    tok, lp = got[0]
    assert lp.logprob == pytest.approx(float(raw[0, tok]), abs=1e-6)
    assert [i for i, _ in lp.top] == raw[0].topk(2).indices.tolist()
    assert got[1][1] is None and got[2][1].top == []
