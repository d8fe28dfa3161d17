"""Speculative decoding counters, vLLM's set: drafts, draft tokens, accepted tokens, accepted per position.

Cumulative over the engine's life; exported with the worker's load beats as kvmesh:spec_decode_* (vLLM's
vllm:spec_decode_* names under the kvmesh prefix).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifies of a request with at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose token i was accepted

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.num_accepted_tokens_per_pos) < drafted:
            self.num_accepted_tokens_per_pos.extend([0] * (drafted - len(self.num_accepted_tokens_per_pos)))
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step gives a request on average (accepted + the one the target always adds)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
