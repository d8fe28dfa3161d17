"""When to speculate and how far: the adaptive rule.

Per request (DraftBudget, on Sequence.spec_budget): the allowed draft length starts at k. A verify that
accepts nothing halves it; one that accepts every drafted token doubles it (at most k). When it reaches 0 the
request drafts nothing for PAUSE_STEPS steps, then tries one token again. A request whose drafts keep failing
thus costs at most one extra verify row every few steps.

Per step (batch_allows): no request drafts in a step whose running decode batch is larger than
disable_by_batch_size: a big batch already fills the forward, and its verify rows would cost more than the
accepted tokens save (vLLM users report n-gram speculation slowing large batches down).
"""
from __future__ import annotations

PAUSE_STEPS = 8


class DraftBudget:
    def __init__(self, k: int) -> None:
        self.k = k
        self.limit = k
        self.pause = 0

    def allowed(self) -> int:
        """Draft tokens this request may propose this step."""
        if self.pause:
            self.pause -= 1
            return 0 if self.pause else 1  # the last paused step probes one token
        return self.limit

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == 0:
            self.limit //= 2
            if self.limit == 0:
                self.limit, self.pause = 1, PAUSE_STEPS
        elif accepted == drafted:
            self.limit = min(self.k, 2 * self.limit)


def batch_allows(num_decoding: int, disable_by_batch_size: int) -> bool:
    return disable_by_batch_size == 0 or num_decoding <= disable_by_batch_size
