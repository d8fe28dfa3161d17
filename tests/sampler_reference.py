"""The per-row sampler kvmesh used before sampling moved to the device: the oracle the batched sampler is tested against.

Sampling inverts each row's cumulative distribution at one uniform number (shared/engine/categorical.py), a
seeded request's number drawn from its own generator, so its tokens do not depend on what else is in the batch.
Logprobs are of the raw model distribution, before any processing (what vLLM and OpenAI report).
"""
from __future__ import annotations

import torch

from shared.engine.categorical import sample_rows, uniforms
from shared.engine.outputs import TokenLogprobs
from shared.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus and below min_p * max prob. logits: [V]."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep a token if the mass before it is below top_p (the most likely token always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class ReferenceSampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def stop_ids(self, seq: Sequence) -> list[int]:
        ids = list(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprobs | None]]:
        logits = logits.float().cpu()
        want_logprobs = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        greedy_plain = [i for i, s in enumerate(seqs) if s.params.greedy and not s.params.uses_penalties
                        and s.num_output_tokens >= s.params.min_tokens]
        tokens = [0] * len(seqs)
        if greedy_plain:
            picks = logits[greedy_plain].argmax(-1).tolist()
            for i, t in zip(greedy_plain, picks):
                tokens[i] = t
        plain = set(greedy_plain)
        for i, seq in enumerate(seqs):
            if i not in plain:
                tokens[i] = self._sample_one(logits[i].clone(), seq)
        results: list[tuple[int, TokenLogprobs | None]] = []
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            lp = None
            n = seq.params.logprobs
            if n is not None:
                row = raw_logprobs[i]
                top = []
                if n > 0:
                    vals, idx = torch.topk(row, n)
                    top = list(zip(idx.tolist(), vals.tolist()))
                lp = TokenLogprobs(tok, float(row[tok]), top)
            results.append((tok, lp))
        return results

    def skip_draw(self, seq: Sequence, vocab_size: int) -> None:
        """Advance a seeded request's generator past one sample taken elsewhere (a prefill worker)."""
        if seq.generator is not None and not seq.params.greedy:
            uniforms(1, seq.generator, torch.device("cpu"))

    def _sample_one(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        apply_penalties(logits, seq)
        if seq.num_output_tokens < p.min_tokens:
            stop = self.stop_ids(seq)
            if stop:
                logits[torch.tensor(stop, dtype=torch.long)] = float("-inf")
        if p.greedy:
            return int(logits.argmax())
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = logits.softmax(-1)
        u = uniforms(1, seq.generator or self.generator, probs.device)
        return int(sample_rows(probs[None], u)[0])
