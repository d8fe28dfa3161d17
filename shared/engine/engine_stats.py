"""A snapshot of an engine's load and cache figures, taken between steps (what load beats publish)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from shared.engine.block_manager import BlockManager
from shared.engine.scheduler import Scheduler
from shared.engine.spec.stats import SpecDecodeStats
from shared.engine.step_metrics import CumulativeHistogram

if TYPE_CHECKING:  # the runner's module imports torch and the kernels; a snapshot only copies its counters
    from shared.engine.verify_graphs import VerifyGraphStats


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int  # held requests (waiting for KV from elsewhere) included
    free_blocks: int
    total_blocks: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in this engine's prefix cache (cumulative)
    prefix_cache_hits: int = 0  # of those, tokens found (cumulative)
    iteration_tokens: CumulativeHistogram | None = None  # tokens computed per step (cumulative)
    spec_decode: SpecDecodeStats | None = None  # speculative decoding counters (None: the engine does not speculate)
    kv_handout_seconds: float = 0.0  # handing prefill-only requests' KV out (OutputProcessor.handout_s, cumulative)
    # How the runner ran its verify steps (graph replays, padded eager, eager; cumulative). None: no speculation.
    verify_steps: VerifyGraphStats | None = None


def engine_stats(scheduler: Scheduler, bm: BlockManager, iteration_tokens: CumulativeHistogram,
                 spec: SpecDecodeStats | None = None, verify: VerifyGraphStats | None = None) -> EngineStats:
    """Copies, not views: the snapshot crosses to the event loop while the engine steps on."""
    return EngineStats(
        running=scheduler.num_running,
        waiting=scheduler.num_waiting + len(scheduler.held),
        free_blocks=bm.num_free_blocks,
        total_blocks=bm.num_blocks,
        prefix_cache_hit_rate=bm.hits / bm.queries if bm.queries else 0.0,
        num_preemptions=scheduler.num_preemptions,
        prefix_cache_queries=bm.queries,
        prefix_cache_hits=bm.hits,
        iteration_tokens=CumulativeHistogram(iteration_tokens.buckets, list(iteration_tokens.counts),
                                             iteration_tokens.total),
        spec_decode=None if spec is None else SpecDecodeStats(spec.num_drafts, spec.num_draft_tokens,
                                                              spec.num_accepted_tokens,
                                                              list(spec.num_accepted_tokens_per_pos)),
        kv_handout_seconds=scheduler.outputs.handout_s if scheduler.outputs is not None else 0.0,
        verify_steps=None if verify is None else replace(verify),
    )
