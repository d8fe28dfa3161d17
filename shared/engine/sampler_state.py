"""Per-sequence sampler inputs kept across steps, updated with only what changed since the last one.

Penalties read a sequence's whole context (repetition: every distinct token of prompt and output; presence and
frequency: the output's counts), and logit_bias / allowed_token_ids are lists the client chose. Rebuilt from
Python lists every step, one request with a long prompt (or a vocabulary-sized allowed list) costs every step
of its worker time in proportion to its context. Here each sequence keeps device rows, a [vocab] bool of the
tokens seen and a [vocab] count of its output tokens, that absorb the tokens appended since the previous step,
and its bias / allowed ids as tensors built once. A step then stacks the rows it needs.

Keyed weakly by the Sequence object, so a finished request's state goes with it. Token lists only grow
(preemption recomputes KV, it keeps the tokens), so `upto` marks what is absorbed. Speculative verification
asks for positions inside a sequence's drafts (shared/engine/spec/draft_position.py): those rows are the
sequence's own plus the drafts before them, never written back.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch


class _SeqState:
    __slots__ = ("upto", "seen", "counts", "bias", "allowed", "__weakref__")

    def __init__(self) -> None:
        self.upto = 0  # tokens of token_ids absorbed into seen / counts
        self.seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output
        self.counts: torch.Tensor | None = None  # [vocab] float32: times in the output
        self.bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values) of logit_bias
        self.allowed: torch.Tensor | None = None  # allowed_token_ids


class SamplerStates:
    def __init__(self) -> None:
        self._states: weakref.WeakKeyDictionary[Any, _SeqState] = weakref.WeakKeyDictionary()

    def _of(self, seq: Any) -> _SeqState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _SeqState()
        return state

    @staticmethod
    def _base(row: Any) -> tuple[Any, list[int]]:
        """A row's sequence and the drafts it sees (a verify position), or the sequence itself."""
        seq = getattr(row, "seq", None)
        return (seq, list(row.drafts)) if seq is not None else (row, [])

    def penalty_rows(self, row: Any, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seen [vocab] bool, output counts [vocab] float32) of a row, its sequence's state brought up to date."""
        seq, drafts = self._base(row)
        st = self._of(seq)
        if st.seen is None or st.seen.device != device or st.seen.shape[0] != vocab:
            st.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            st.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            st.upto = 0
        assert st.counts is not None
        n_prompt, n = seq.num_prompt_tokens, seq.num_tokens
        if st.upto < n:
            new = seq.token_ids[st.upto:n]
            ids = torch.tensor(new, dtype=torch.long).to(device, non_blocking=True)
            st.seen[ids] = True
            out_from = max(0, n_prompt - st.upto)
            if out_from < len(new):
                out = ids[out_from:]
                st.counts.index_put_((out,), torch.ones(len(out), device=device), accumulate=True)
            st.upto = n
        if not drafts:
            return st.seen, st.counts
        d = torch.tensor(drafts, dtype=torch.long).to(device, non_blocking=True)
        seen, counts = st.seen.clone(), st.counts.clone()
        seen[d] = True
        counts.index_put_((d,), torch.ones(len(d), device=device), accumulate=True)
        return seen, counts

    def bias(self, row: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases) of the row's logit_bias, as tensors built once per sequence."""
        st = self._of(self._base(row)[0])
        if st.bias is None or st.bias[0].device != device:
            lb = row.params.logit_bias
            st.bias = (torch.tensor(list(lb.keys()), dtype=torch.long).to(device),
                       torch.tensor(list(lb.values()), dtype=torch.float32).to(device))
        return st.bias

    def allowed(self, row: Any, device: torch.device) -> torch.Tensor:
        """The row's allowed_token_ids as a tensor built once per sequence."""
        st = self._of(self._base(row)[0])
        if st.allowed is None or st.allowed.device != device:
            st.allowed = torch.tensor(list(row.params.allowed_token_ids), dtype=torch.long).to(device)
        return st.allowed
