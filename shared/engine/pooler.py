"""Hidden states -> one vector per prompt: vLLM's poolers (LAST, MEAN, CLS), then the task's head.

embed: the pooled hidden state, cut to the first `dimensions` values (Matryoshka) and L2-normalized;
classify: the model's score head over the pooled state, then sigmoid (one label) or softmax (several).
Everything after the model runs in float32, as vLLM's heads do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[tokens, hidden] of packed prompts -> [prompts, hidden]."""
    ends = torch.tensor(seq_lens, device=hidden.device).cumsum(0)
    starts = ends - torch.tensor(seq_lens, device=hidden.device)
    if pooling_type == "LAST":
        return hidden[ends - 1]
    if pooling_type == "CLS":
        return hidden[starts]
    if pooling_type == "MEAN":
        return torch.stack([hidden[s:e].float().mean(0).to(hidden.dtype)
                            for s, e in zip(starts.tolist(), ends.tolist())])
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def embed_head(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    out = pooled.float()
    if dimensions is not None:
        out = out[..., :dimensions]
    return F.normalize(out, p=2, dim=-1) if normalize else out


def classify_head(logits: torch.Tensor, activation: bool) -> torch.Tensor:
    logits = logits.float()
    if not activation:
        return logits
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
