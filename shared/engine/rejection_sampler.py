"""Rejection sampling for speculative decoding: the emitted tokens are distributed exactly as the target's.

For each drafted position j in order: accept draft d with probability min(1, p_j(d) / q_j(d)); at the first
rejection emit a token drawn from the residual max(p_j - q_j, 0), normalised, and stop; when every draft is
accepted, emit a bonus token drawn from p_k. p is the target's processed distribution at each position (the
normal sampler's own processing: shared/engine/sampler.py); q the drafter's. A proposer that looks tokens up
(n-gram, suffix) drafts a point mass: q_j(d) = 1, so d is accepted with probability p_j(d) and the residual
is p_j with d removed. Greedy targets are one-hot, which makes this exact greedy verification.

Draws come from the request's own generator when it is seeded (so a seeded request's tokens do not depend on
its batch), else from the sampler's. Sampling is the exponential race, as in the sampler: argmax(w / E),
E ~ Exp(1), draws index i with probability w_i / sum(w) without normalising w.
"""
from __future__ import annotations

import torch


@torch.inference_mode()
def rejection_sample(probs: torch.Tensor, drafts: list[list[int]], generators: list[torch.Generator],
                     draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """probs: [sum(len(d) + 1), vocab] target probabilities, each request's len(d) + 1 rows in turn.
    draft_probs: [sum(len(d)), vocab] of a draft model, or None for point-mass drafts.
    Returns each request's emitted tokens: its accepted drafts, then one corrected or bonus token."""
    dev = probs.device
    accepted_parts, alt_parts = [], []
    row = qrow = 0
    for d, gen in zip(drafts, generators):
        k = len(d)
        p = probs[row : row + k + 1]
        ids = torch.tensor(d, dtype=torch.long, device=dev)
        at = torch.arange(k, device=dev)
        pd = p[at, ids]
        u = torch.rand(k, generator=gen, device=dev)
        if draft_probs is None:
            accept = u < pd
            residual = p[:k].clone()
            residual[at, ids] = 0.0
        else:
            q = draft_probs[qrow : qrow + k]
            accept = u * q[at, ids] < pd  # u < p/q without dividing by a zero q
            residual = (p[:k] - q).clamp_(min=0.0)
            qrow += k
        dist = torch.cat([residual, p[k:]])
        noise = torch.empty_like(dist).exponential_(generator=gen)
        alt_parts.append((dist / noise).argmax(-1))
        accepted_parts.append(accept)
        row += k + 1
    # One copy to the host for the whole batch.
    flat = torch.cat([torch.cat(accepted_parts).long(), torch.cat(alt_parts)]).tolist()
    n_acc_rows = sum(len(d) for d in drafts)
    acc, alt = flat[:n_acc_rows], flat[n_acc_rows:]
    out: list[list[int]] = []
    a = b = 0
    for d in drafts:
        k = len(d)
        n = next((j for j in range(k) if not acc[a + j]), k)
        out.append(list(d[:n]) + [alt[b + n]])
        a += k
        b += k + 1
    return out
