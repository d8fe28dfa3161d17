"""The drafter's distributions q of a verify group, rows aligned with rejection_sample's draft rows.

None when no request of the group carries a draft model's q (lookup proposers draft point masses: the rejection
sampler's own point-mass form). A request without q beside ones with it gets one-hot rows, which the general
form min(1, p/q), max(p - q, 0) turns into exactly the point-mass rule.
"""
from __future__ import annotations

import torch

from shared.engine.sequence import Sequence


def draft_probs_of(group: list[tuple[Sequence, int, int]], like: torch.Tensor) -> torch.Tensor | None:
    """group: (sequence, k drafts verified, first logits row) as verify.py holds them; like: the target's probs."""
    if all(seq.spec_draft_probs is None for seq, _, _ in group):
        return None
    rows = []
    for seq, k, _ in group:
        if seq.spec_draft_probs is not None:
            rows.append(seq.spec_draft_probs[:k].to(like.device, like.dtype))
        else:
            ids = torch.tensor(seq.spec_token_ids[:k], dtype=torch.long, device=like.device)
            rows.append(torch.nn.functional.one_hot(ids, like.shape[1]).to(like.dtype))
    return torch.cat(rows)
