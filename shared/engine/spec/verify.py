"""The verify step's sampling: the target's tokens at every drafted position, and what each request keeps.

A request verifying k drafts has k + 1 logits rows (its last token, then each draft). Greedy requests take
the normal sampler's tokens at every row (shared/engine/sampler.py, through DraftPosition views, so logit
bias, penalties and min_tokens see the drafts before each row) and keep the drafts up to the first that differs
from the target, then the target's token there: the same tokens as decoding one at a time. Other requests go
through the rejection sampler on the same processed probabilities. A structured-output request's rows are first
masked by its grammar at each position (token_bitmask, shared/engine/spec/grammar_drafts.py). Logprobs are
always the target's (the raw distribution at the row that emitted the token), as without speculation.
"""
from __future__ import annotations

import torch

from kernels.token_bitmask import apply_token_bitmask
from shared.engine.outputs import TokenLogprobs
from shared.engine.rejection_sampler import rejection_sample
from shared.engine.sampler import Sampler, sampling_probs
from shared.engine.sequence import Sequence
from shared.engine.spec.draft_position import DraftPosition, positions
from shared.engine.spec.draft_probs import draft_probs_of

Verified = tuple[list[int], list[TokenLogprobs | None]]  # emitted tokens (accepted drafts + one), their logprobs


@torch.inference_mode()
def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], ks: list[int],
           token_bitmask: torch.Tensor | None = None) -> list[Verified]:
    """logits: [sum(k + 1), vocab], each sequence's k + 1 rows in turn; ks[i] drafts of seqs[i] are verified.
    token_bitmask: int32 [sum(k + 1), words], the grammar's mask at every row (None: no request has a grammar)."""
    starts, at = [], 0
    for k in ks:
        starts.append(at)
        at += k + 1
    assert logits.shape[0] == at, f"{logits.shape[0]} logits rows for {at} verify positions"
    results: list[Verified | None] = [None] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    other = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if greedy:
        _greedy(sampler, logits, [(seqs[i], ks[i], starts[i]) for i in greedy], results, greedy, token_bitmask)
    if other:
        _rejection(sampler, logits, [(seqs[i], ks[i], starts[i]) for i in other], results, other, token_bitmask)
    return results  # type: ignore[return-value]


def _rows(group: list[tuple[Sequence, int, int]]) -> tuple[list[int], list[DraftPosition]]:
    rows: list[int] = []
    views: list[DraftPosition] = []
    for seq, k, start in group:
        rows.extend(range(start, start + k + 1))
        views.extend(positions(seq, k))
    return rows, views


def _select(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, device=logits.device))


def _greedy(sampler: Sampler, logits: torch.Tensor, group, results, where, bitmask) -> None:  # noqa: ANN001
    rows, views = _rows(group)
    mask = None if bitmask is None else _select(bitmask, rows)
    samples = sampler.sample(_select(logits, rows), views, token_bitmask=mask)  # type: ignore[arg-type]
    at = 0
    for (seq, k, _), i in zip(group, where):
        mine = samples[at : at + k + 1]
        n = next((j for j in range(k) if mine[j][0] != seq.spec_token_ids[j]), k)
        results[i] = ([t for t, _ in mine[: n + 1]], [lp for _, lp in mine[: n + 1]])
        at += k + 1


def _rejection(sampler: Sampler, logits: torch.Tensor, group, results, where, bitmask) -> None:  # noqa: ANN001
    rows, views = _rows(group)
    lg = _select(logits, rows).float()
    params = [v.params for v in views]
    top_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
    raw = torch.log_softmax(lg, dim=-1) if top_n is not None else None
    if bitmask is not None:  # as in Sampler.sample: the grammar first, the raw logprobs before it
        apply_token_bitmask(lg, _select(bitmask, rows))
    sampler.process_logits(lg, views)  # type: ignore[arg-type]
    probs = sampling_probs(lg, params)
    emitted = rejection_sample(probs, [seq.spec_token_ids[:k] for seq, k, _ in group],
                               [sampler.generator_for(seq) for seq, _, _ in group],
                               draft_probs=draft_probs_of(group, probs))  # a draft model's q; None: point masses
    if raw is None:
        for toks, i in zip(emitted, where):
            results[i] = (toks, [None] * len(toks))
        return
    # Logprobs of the emitted tokens at the rows that emitted them: the target's, as without speculation.
    lp_rows, lp_tokens, lp_params = [], [], []
    at = 0
    for (seq, k, _), toks in zip(group, emitted):
        lp_rows.extend(range(at, at + len(toks)))
        lp_tokens.extend(toks)
        lp_params.extend([seq.params] * len(toks))
        at += k + 1
    index = torch.tensor(lp_rows, device=raw.device)
    lps = Sampler._to_host(torch.tensor(lp_tokens, device=raw.device), raw.index_select(0, index), top_n, lp_params)
    at = 0
    for toks, i in zip(emitted, where):
        results[i] = (toks, [lp for _, lp in lps[at : at + len(toks)]])
        at += len(toks)
