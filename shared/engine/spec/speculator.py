"""What the engine asks of speculative decoding: drafts before a step, bookkeeping after its verify.

Before scheduling, every running request that is decoding (one token to compute, at least one output token,
not inside a reasoning section that precedes its structured-output grammar) gets up to k drafts from the
proposer in Sequence.spec_token_ids, within its adaptive budget (shared/engine/spec/adaptive.py), its
max_tokens and the model's length; a structured-output request's drafts are cut where its grammar would
reject one (shared/engine/spec/grammar_drafts.py). The scheduler may cut them (token budget, free blocks); the runner computes
the last token and the drafts in one forward; verify.py decides what is kept.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from shared.engine.outputs import TokenLogprobs
from shared.engine.sampler import Sampler
from shared.engine.sequence import Sequence
from shared.engine.spec.adaptive import DraftBudget, batch_allows
from shared.engine.spec.draft_model import DraftModel, DraftModelProposer
from shared.engine.spec.grammar_drafts import grammar_prefix
from shared.engine.spec.ngram import NgramProposer
from shared.engine.spec.stats import SpecDecodeStats
from shared.engine.spec.suffix import SuffixProposer
from shared.engine.spec.verify import verify
from shared.spec_config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]: ...

    def finished(self, seq: Sequence) -> None: ...


def make_proposer(c: SpeculativeConfig, draft: DraftModel | None = None, sampler: Sampler | None = None) -> Proposer:
    if c.method == "ngram":
        return NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max)
    if c.method == "suffix":
        return SuffixProposer(c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
                              c.suffix_decoding_min_token_prob, c.suffix_decoding_max_spec_factor)
    if c.method == "draft_model":
        assert draft is not None and sampler is not None, "the engine loads the draft model before the speculator"
        return DraftModelProposer(draft, sampler.generator_for)
    raise AssertionError(c.method)  # SpeculativeConfig admits no other


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None,
                 sampler: Sampler | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config, draft, sampler)
        self.stats = SpecDecodeStats()
        self.steps_off = 0  # steps the batch-size rule switched speculation off (for benches)

    def propose(self, running: Iterable[Sequence]) -> None:
        decoding = []
        running = list(running)
        if isinstance(self.proposer, DraftModelProposer):  # its KV of requests no longer running is freed
            self.proposer.kv.retain({s.request_id for s in running})
        for seq in running:
            seq.spec_token_ids = []
            seq.spec_draft_probs = None
            # While a reasoning model still reasons, a draft could cross into its grammar: no drafts until then.
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0 and (seq.matcher is None or seq.reasoning_over):
                decoding.append(seq)
        if not decoding:
            return
        if not batch_allows(len(decoding), self.config.disable_by_batch_size):
            self.steps_off += 1
            return
        wants = []
        for seq in decoding:
            if seq.spec_budget is None:
                seq.spec_budget = DraftBudget(self.k)
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            k = min(room, seq.spec_budget.allowed())
            if k > 0:
                wants.append((seq, k))
        if isinstance(self.proposer, DraftModelProposer):  # one batch of k draft forwards for every request
            # A sampled structured request does not draft from a model: cutting q's draws at the grammar would
            # condition them on being legal, and min(1, p/q) with that q is no longer exact. A lookup's drafts
            # are point masses (nothing to condition) and greedy verification takes the masked argmax: both stay.
            wants = [(seq, k) for seq, k in wants if seq.matcher is None or seq.params.greedy]
            for (seq, k), drafts in zip(wants, self.proposer.propose_batch(wants)):
                seq.spec_token_ids = self._legal(seq, drafts[:k])
            return
        for seq, k in wants:
            seq.spec_token_ids = self._legal(seq, self.proposer.propose(seq, k)[:k])

    @staticmethod
    def _legal(seq: Sequence, drafts: list[int]) -> list[int]:
        """A structured request's drafts, cut where its grammar would reject one (no verification wasted)."""
        return drafts if seq.matcher is None else grammar_prefix(seq.matcher, drafts)

    def verify(self, sampler: Sampler, logits: torch.Tensor, drafts: list[tuple[Sequence, int]],
               token_bitmask: torch.Tensor | None = None) -> list[tuple[Sequence, list[int], list[TokenLogprobs | None]]]:
        """What each (sequence, k drafts) of a verify step keeps (verify.py: accepted drafts, then the target's
        token), from its k + 1 logits rows in turn; counts them and adapts each request's draft budget.
        token_bitmask: the grammar masks of those rows (grammar_drafts.draft_bitmask), None without a grammar."""
        seqs, ks = [s for s, _ in drafts], [k for _, k in drafts]
        kept = []
        for seq, k, (tokens, lps) in zip(seqs, ks, verify(sampler, logits, seqs, ks, token_bitmask)):
            self.stats.observe(k, len(tokens) - 1)
            if seq.spec_budget is not None:
                seq.spec_budget.update(k, len(tokens) - 1)
            kept.append((seq, tokens, lps))
        return kept

    def learn_output(self, cache_salt: str | None, token_ids: list[int]) -> bool:
        """Another decode worker's finished output joins the worker-wide suffix table; False (nothing learned)
        for proposers without one."""
        if not isinstance(self.proposer, SuffixProposer):
            return False
        self.proposer.learn(cache_salt, token_ids)
        return True

    def release(self, request_id: str) -> None:
        """An aborted request: a draft model's KV for it is freed now."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.release(request_id)

    def check_integrity(self, live: set[str]) -> None:
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.kv.check_integrity(live)

    def observe_finished(self, seqs: Iterable[Sequence]) -> None:
        """Finished outputs feed the proposer's worker-wide table (suffix decoding)."""
        for seq in seqs:
            if seq.is_finished:
                self.proposer.finished(seq)
