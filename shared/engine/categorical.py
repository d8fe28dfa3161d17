"""One draw per row from a categorical distribution given by unnormalised weights: the inverse of the row's
cumulative distribution at one uniform number.

The sampler used the exponential race (argmax of w / E, E ~ Exp(1) per token): the same distribution, but a whole
vocabulary of random numbers per draw. On a CPU that was most of a sampled token's host work: Exp(1) noise for
SmolLM2's 49,152 tokens took 2.0 ms a row (torch's exponential_), against ~0.1 ms for this (a float64 cumulative
sum and a binary search). float64 keeps the sum's rounding far below any probability a float32 softmax produces.

A draw consumes exactly one number of its generator (DRAW_DTYPE), whatever the vocabulary: a worker that lets
another take a seeded request's first sample advances the generator by one draw (Sampler.skip_draw).
"""
from __future__ import annotations

import torch

DRAW_DTYPE = torch.float64


def uniforms(rows: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """rows uniform numbers in [0, 1) from generator, one per draw."""
    return torch.rand(rows, generator=generator, device=device, dtype=DRAW_DTYPE)


def sample_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [rows, n] >= 0, each row with positive mass; u [rows] in [0, 1). Index i of each row with
    probability weights[i] / sum(weights): the first i whose cumulative weight exceeds u * total (so a token of
    weight 0 is never drawn; a row of no mass at all, which callers never use, gives the last index)."""
    cdf = weights.to(DRAW_DTYPE).cumsum(-1)
    total = cdf[:, -1:]
    # Below the total even where u * total rounds up to it: the answer is then the last token of positive weight.
    target = torch.minimum(u.to(DRAW_DTYPE).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)
