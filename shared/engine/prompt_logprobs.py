"""Prompt logprobs: for each prompt position a step computes, the logprob of the next prompt token (and the
top-n), from the model's fp32 logits and their log-softmax.

A chunk of 2,048 prompt tokens at a 151,936-token vocabulary would need 2.5 GB for both at once, so rows go
through in slices of PROMPT_LOGPROB_SLICE (0.3 GB); the memory profile runs this very function over a full
chunk (shared/engine/profile_run.py), so the slices' peak is inside the budget.
"""
from __future__ import annotations

import torch

from shared.engine.outputs import TokenLogprobs
from shared.engine.sequence import Sequence

PROMPT_LOGPROB_SLICE = 256


def prompt_logprob_rows(scheduled: list[tuple[Sequence, int]], last_row: list[int]) -> list[tuple[int, Sequence, int]]:
    """(row, sequence, prompt token it predicts) for the prompt positions computed this step by requests
    that want prompt logprobs: the row at position p gives the logprob of prompt token p + 1."""
    out = []
    for (seq, n), last in zip(scheduled, last_row):
        if seq.params.prompt_logprobs is None or seq.num_computed_tokens >= seq.num_prompt_tokens:
            continue
        start = seq.num_computed_tokens
        first_row = last - n + 1
        for p in range(start, min(start + n, seq.num_prompt_tokens - 1)):
            out.append((first_row + p - start, seq, p + 1))
    return out


@torch.inference_mode()
def record_prompt_logprobs(compute_logits, hidden: torch.Tensor, rows: list[tuple[int, Sequence, int]],
                           slice_rows: int = PROMPT_LOGPROB_SLICE) -> None:
    """hidden[i] is the hidden state of rows[i]; compute_logits maps hidden states to logits (made float32 here)."""
    for at in range(0, len(rows), slice_rows):
        _record(compute_logits(hidden[at : at + slice_rows]), rows[at : at + slice_rows])


def _record(logits: torch.Tensor, rows: list[tuple[int, Sequence, int]]) -> None:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    del logits
    targets = torch.tensor([seq.token_ids[t] for _, seq, t in rows], device=logprobs.device)
    picked_t = logprobs.gather(1, targets.unsqueeze(1))
    # Rank as vLLM reports it: 1 + how many tokens are strictly more likely than the prompt's.
    ranks = ((logprobs > picked_t).sum(1) + 1).tolist()
    picked = picked_t.squeeze(1).tolist()
    top_n = max(seq.params.prompt_logprobs or 0 for _, seq, _ in rows)
    vals, ids = (logprobs.topk(top_n, dim=-1) if top_n else (None, None))
    vals, ids = (vals.tolist(), ids.tolist()) if top_n else ([], [])
    for i, (_, seq, t) in enumerate(rows):
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context to be predicted from
        if t != len(seq.prompt_logprobs):
            continue  # recomputed after a preemption: already recorded
        n = seq.params.prompt_logprobs or 0
        top = list(zip(ids[i][:n], vals[i][:n])) if n else []
        seq.prompt_logprobs.append(TokenLogprobs(seq.token_ids[t], picked[i], top, ranks[i]))
