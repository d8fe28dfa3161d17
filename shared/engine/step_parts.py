"""What an executor's step reads from the engine that owns it: the engine's parts, named as a protocol so that
the executors (shared/engine/executor.py, sync_step.py) depend on these names and not on the engine's module,
which depends on them."""
from __future__ import annotations

from typing import Any, Protocol

from shared.engine.grammar import GrammarBackend
from shared.engine.scheduler import Scheduler
from shared.engine.spec.speculator import Speculator
from shared.engine.step_metrics import CumulativeHistogram


class StepParts(Protocol):
    iteration_tokens: CumulativeHistogram
    runner: Any  # a ModelRunner or a tensor-parallel driver's runner with the same methods
    sampler: Any  # shared.engine.sampler.Sampler
    scheduler: Scheduler
    speculator: Speculator | None

    def grammar(self) -> GrammarBackend: ...
