"""The logprobs of one sampled token: shared by the engine (which computes them) and the wire protocol
(which carries them), below both so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives, from the raw model distribution."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # the token's rank in the distribution (1: the most likely), where computed
