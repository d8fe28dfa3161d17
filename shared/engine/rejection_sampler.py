"""Rejection sampling for speculative decoding: the emitted tokens are distributed exactly as the target's.

For each drafted position j in order: accept draft d with probability min(1, p_j(d) / q_j(d)); at the first
rejection emit a token drawn from the residual max(p_j - q_j, 0), normalised, and stop; when every draft is
accepted, emit a bonus token drawn from p_k. p is the target's processed distribution at each position (the
normal sampler's own processing: shared/engine/sampler.py); q the drafter's. A proposer that looks tokens up
(n-gram, suffix) drafts a point mass: q_j(d) = 1, so d is accepted with probability p_j(d) and the residual
is p_j with d removed. Greedy targets are one-hot, which makes this exact greedy verification.

Draws come from the request's own generator when it is seeded (so a seeded request's tokens do not depend on
its batch), else from the sampler's. A corrected or bonus token is drawn as in the sampler
(shared/engine/categorical.py): index i with probability w_i / sum(w), without normalising w.
"""
from __future__ import annotations

import torch

from shared.engine.categorical import DRAW_DTYPE, sample_rows, uniforms


def _draw(shape_rows: list[int], generators: list[torch.Generator], fill, like: torch.Tensor) -> torch.Tensor:
    """One tensor of random draws, request by request in order (a request's rows from its own generator); runs
    of requests sharing a generator draw together: one call for a whole batch of unseeded requests."""
    parts, i = [], 0
    while i < len(generators):
        j = i
        while j < len(generators) and generators[j] is generators[i]:
            j += 1
        n = sum(shape_rows[i:j])
        parts.append(fill(like.new_empty((n,) + tuple(like.shape[1:])), generators[i]))
        i = j
    return torch.cat(parts) if len(parts) != 1 else parts[0]


@torch.inference_mode()
def rejection_sample(probs: torch.Tensor, drafts: list[list[int]], generators: list[torch.Generator],
                     draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """probs: [sum(len(d) + 1), vocab] target probabilities, each request's len(d) + 1 rows in turn.
    draft_probs: [sum(len(d)), vocab] of a draft model, or None for point-mass drafts.
    Returns each request's emitted tokens: its accepted drafts, then one corrected or bonus token."""
    dev = probs.device
    ks = [len(d) for d in drafts]
    # Row of each draft in probs (a request's k draft rows, then its bonus row).
    draft_rows, at = [], 0
    for k in ks:
        draft_rows.extend(range(at, at + k))
        at += k + 1
    rows = torch.tensor(draft_rows, dtype=torch.long, device=dev)
    ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)
    pd = probs[rows, ids]
    u = _draw(ks, generators, lambda t, g: t.uniform_(generator=g), pd)
    dist = probs.clone()
    if draft_probs is None:
        accept = u < pd
        dist[rows, ids] = 0.0  # the residual of a point mass: p without the drafted token
    else:
        accept = u * draft_probs[torch.arange(len(draft_rows), device=dev), ids] < pd  # u < p/q, q never divides
        dist[rows] = (probs[rows] - draft_probs).clamp_(min=0.0)
    alt = sample_rows(dist, _draw([k + 1 for k in ks], generators, lambda t, g: uniforms(len(t), g, t.device),
                                  u.new_empty(len(dist), dtype=DRAW_DTYPE)))
    # One copy to the host for the whole batch.
    flat = torch.cat([accept.long(), alt]).tolist()
    acc, alt_ids = flat[: len(draft_rows)], flat[len(draft_rows) :]
    out: list[list[int]] = []
    a = b = 0
    for d, k in zip(drafts, ks):
        n = next((j for j in range(k) if not acc[a + j]), k)
        out.append(list(d[:n]) + [alt_ids[b + n]])
        a += k
        b += k + 1
    return out
