"""Turns a step's logits into tokens on the device they are on, for the whole batch at once.

Order (per row, as OpenAI and vLLM): logit_bias and allowed_token_ids, bad words, repetition/presence/frequency
penalties, min_tokens (stop ids masked), then greedy rows take the argmax; the others are divided by
their temperature, filtered by top-k, the top-p nucleus and min-p, and sampled by the inverse of their
cumulative distribution at one uniform number each (shared/engine/categorical.py). A seeded request draws its
number from its own generator, so its tokens do not depend on what else is in the batch; the other rows share
one batched draw.
Logprobs are of the raw model distribution, before any processing (what vLLM and OpenAI report).

Every per-row parameter becomes a small tensor, and only the sampled ids (and requested logprobs)
come back to the host, in one copy: on a GPU the logits [rows, vocab] never leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.token_bitmask import apply_token_bitmask
from shared.engine.categorical import sample_rows, uniforms
from shared.engine.outputs import TokenLogprobs
from shared.engine.sampled_ids import SampledIds
from shared.engine.sampler_state import SamplerStates
from shared.sampling_params import SamplingParams
from shared.engine.sequence import Sequence

NEG_INF = float("-inf")


@dataclass
class _Rows:
    """Host-side lists of (row, token id[, value]) pairs, uploaded together when non-empty."""

    rows: list[int]
    ids: list[int]

    @classmethod
    def empty(cls) -> _Rows:
        return cls([], [])

    def add(self, row: int, ids) -> None:
        ids = list(ids)
        self.rows.extend([row] * len(ids))
        self.ids.extend(ids)

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor([self.rows, self.ids], dtype=torch.long).to(device, non_blocking=True)
        return t[0], t[1]


def apply_bad_words(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """vLLM's bad_words: a word's last token is masked when the output so far ends with the word's other
    tokens (a one-token word is always masked), so no bad word is ever completed."""
    banned = _Rows.empty()
    for i, s in enumerate(seqs):
        words = s.params.bad_words_ids
        if not words:
            continue
        toks, n_out = s.token_ids, s.num_output_tokens
        for w in words:
            head = w[:-1]
            if not head or (n_out >= len(head) and toks[len(toks) - len(head):] == head):
                banned.add(i, (w[-1],))
    if banned.rows:
        r, t = banned.tensors(logits.device)
        logits[r, t] = NEG_INF


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], states: SamplerStates | None = None) -> None:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties, in place.
    states: the sampler's per-sequence rows (sampler_state.py), kept across steps; None: built for this call."""
    states = states if states is not None else SamplerStates()
    rows, seen, counts, rep, freq, pres = [], [], [], [], [], []
    vocab, dev = logits.shape[-1], logits.device
    for i, s in enumerate(seqs):
        p = s.params
        use_out = bool((p.presence_penalty or p.frequency_penalty) and s.num_output_tokens)
        if p.repetition_penalty == 1.0 and not use_out:
            continue
        row_seen, row_counts = states.penalty_rows(s, vocab, dev)
        rows.append(i)
        seen.append(row_seen)
        counts.append(row_counts)
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty if use_out else 0.0)
        pres.append(p.presence_penalty if use_out else 0.0)
    if not rows:
        return
    idx = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    sub = logits.index_select(0, idx)
    mask = torch.stack(seen)
    rp = torch.tensor(rep).to(dev, non_blocking=True).unsqueeze(1)
    sub = torch.where(mask, torch.where(sub > 0, sub / rp, sub * rp), sub)
    c = torch.stack(counts)
    f = torch.tensor(freq).to(dev, non_blocking=True).unsqueeze(1)
    pr = torch.tensor(pres).to(dev, non_blocking=True).unsqueeze(1)
    sub = sub - (f * c + pr * (c > 0).float())
    logits.index_copy_(0, idx, sub)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """top-k, then top-p over what survives, then min-p; the most likely token always survives."""
    vocab = logits.shape[-1]
    dev = logits.device
    use_k = any(0 < p.top_k < vocab for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k and not use_p:
        # top-k alone needs only the k largest values, not a full sort of the vocabulary.
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top = logits.topk(max(ks), dim=-1).values
        idx = torch.tensor([max(k, 1) - 1 for k in ks]).to(dev, non_blocking=True).unsqueeze(1)
        off = torch.tensor([k == 0 for k in ks]).to(dev, non_blocking=True).unsqueeze(1)
        kth = top.gather(1, idx).masked_fill_(off, NEG_INF)
        # By value, so tokens tied with the k-th all stay (the per-row rule).
        logits.masked_fill_(logits < kth, NEG_INF)
    elif use_p:
        sorted_logits, order = logits.sort(-1, descending=True)
        if use_k:
            k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
            kth = sorted_logits.gather(1, (k - 1).to(dev, non_blocking=True).unsqueeze(1))
            sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
            logits.masked_fill_(logits < kth, NEG_INF)
        top_p = torch.tensor([p.top_p for p in params]).to(dev, non_blocking=True).unsqueeze(1)
        sorted_probs = sorted_logits.softmax(-1)
        # Keep a token if the mass before it is below top_p.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        logits.masked_fill_(torch.zeros_like(drop).scatter_(1, order, drop), NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params]).to(dev, non_blocking=True).unsqueeze(1)
        probs = logits.softmax(-1)
        logits.masked_fill_(probs < min_p * probs.amax(-1, keepdim=True), NEG_INF)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row samples from: processed float32 logits (modified in place) divided by
    the temperature (1 for greedy rows), filtered by top-k/top-p/min-p, softmaxed."""
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
    logits.div_(temps.to(logits.device, non_blocking=True).unsqueeze(1))
    filter_logits(logits, params)
    return logits.softmax(-1)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0, device: str | torch.device = "cpu") -> None:
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # rows without a seed
        self.states = SamplerStates()  # per-sequence penalty rows, bias and allowed ids, kept across steps

    def stop_ids(self, seq: Sequence) -> list[int]:
        ids = list(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids

    def _own_generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.params.seed)
        return seq.generator

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """Where a row's random draws come from: a seeded request's own generator, else the sampler's."""
        return self._own_generator(seq) if seq.params.seed is not None else self.generator

    @torch.inference_mode()
    def skip_draw(self, seq: Sequence, vocab_size: int) -> None:
        """Advance a seeded request's generator past one sample taken elsewhere (a prefill worker)."""
        if seq.params.seed is not None and not seq.params.greedy:
            uniforms(1, self._own_generator(seq), self.device)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], token_bitmask: torch.Tensor | None = None
               ) -> list[tuple[int, TokenLogprobs | None]]:
        """logits: [len(seqs), vocab] on the sampler's device (modified in place). token_bitmask: int32
        [len(seqs), ceil(vocab / 32)] in xgrammar's layout (structured outputs; rows of -1 are free)."""
        return self.sample_on_device(logits, seqs, token_bitmask).result()

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence], token_bitmask: torch.Tensor | None = None
                         ) -> SampledIds:
        """What sample returns, still on the device: nothing here waits for it."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [{len(seqs)}, vocab], got {tuple(logits.shape)}")
        if token_bitmask is None and all(s.plain_greedy and s.num_output_tokens >= s.min_tokens for s in seqs):
            # Greedy rows need no float32 copy of the vocabulary: the argmax of the model-dtype logits is the same.
            return SampledIds(logits.argmax(-1), None, None, [])
        params = [s.params for s in seqs]
        top_n = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1) if top_n is not None else None
        if token_bitmask is not None:
            # Before everything else, like logit_bias: the grammar decides what may come next at all.
            apply_token_bitmask(logits, token_bitmask)
        if all(p.greedy for p in params) and not self._processes(seqs):
            tokens = logits.argmax(-1)
        else:
            tokens = self._sample_processed(logits, seqs)
        return SampledIds(tokens, raw, top_n, params)

    # --- processing -------------------------------------------------------------------------------

    def _processes(self, seqs: list[Sequence]) -> bool:
        """Whether any row needs more than temperature and sampling (greedy fast path otherwise)."""
        return any(s.params.uses_penalties or s.params.logit_bias or s.params.allowed_token_ids is not None
                   or s.params.bad_words_ids or s.num_output_tokens < s.params.min_tokens for s in seqs)

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """In place, on float32 logits: logit_bias and allowed ids, penalties, min_tokens (what a greedy row's
        argmax is taken over). The rejection sampler (shared/engine/rejection_sampler.py) calls this too."""
        self._apply_bias_and_allowed(logits, seqs)
        apply_bad_words(logits, seqs)
        apply_penalties(logits, seqs, self.states)
        self._apply_min_tokens(logits, seqs)

    def _sample_processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        params = [s.params for s in seqs]
        self.process_logits(logits, seqs)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(-1)
        probs = sampling_probs(logits, params)
        u = uniforms(len(seqs), self.generator, dev)
        for i, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.greedy:
                u[i] = uniforms(1, self._own_generator(s), dev)[0]
        sampled = sample_rows(probs, u)
        if any(greedy):
            is_greedy = torch.tensor(greedy).to(dev, non_blocking=True)
            sampled = torch.where(is_greedy, logits.argmax(-1), sampled)
        return sampled

    def _apply_bias_and_allowed(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        # Each sequence's ids and values are tensors built once (sampler_state.py), not lists rebuilt every step.
        dev = logits.device
        bias_rows, bias_ids, bias_values = [], [], []
        allowed_rows, allowed_ids, restricted = [], [], []
        for i, s in enumerate(seqs):
            if s.params.logit_bias:
                ids, values = self.states.bias(s, dev)
                bias_rows.append(torch.full_like(ids, i))
                bias_ids.append(ids)
                bias_values.append(values)
            if s.params.allowed_token_ids is not None:
                ids = self.states.allowed(s, dev)
                allowed_rows.append(torch.full_like(ids, i))
                allowed_ids.append(ids)
                restricted.append(i)
        if bias_rows:
            logits.index_put_((torch.cat(bias_rows), torch.cat(bias_ids)),
                              torch.cat(bias_values).to(logits.dtype), accumulate=True)
        if restricted:
            keep = torch.ones_like(logits, dtype=torch.bool)
            keep[torch.tensor(restricted).to(dev)] = False
            keep[torch.cat(allowed_rows), torch.cat(allowed_ids)] = True
            logits.masked_fill_(~keep, NEG_INF)

    def _apply_min_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        stops = _Rows.empty()
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                stops.add(i, self.stop_ids(s))
        if stops.rows:
            r, t = stops.tensors(logits.device)
            logits[r, t] = NEG_INF

    # --- results ------------------------------------------------------------------------------------

    @staticmethod
    def _to_host(tokens: torch.Tensor, raw: torch.Tensor | None, top_n: int | None,
                 params: list[SamplingParams]) -> list[tuple[int, TokenLogprobs | None]]:
        return SampledIds(tokens, raw, top_n, params).result()
