"""Async scheduling: the host schedules and builds step n+1 while step n still computes (vLLM's async scheduling).

A synchronous step waits for its sampled ids before the next one is scheduled, so the device idles through
update_from_output, schedule() and the runner's build. Here one call of step():

1. advance(n): step n's tokens count as computed, and every sequence that sampled in step n gets a placeholder
   token: the scheduler sees it one token longer, as it will be;
2. schedules step n+1 and launches it: its inputs are built on the host from the placeholders, and the rows of
   the sequences that sampled in step n read their ids from step n's sampled-ids tensor on the device;
3. finish(n): waits for step n's ids (copied without blocking into pinned memory at launch) and replaces each
   placeholder with its token through the scheduler's usual append: stop ids, max_tokens, outputs.

A sequence that finished in step n (or was aborted) also computed a row in step n+1: advance and finish skip it,
so that extra token reaches no output, block hash or tier, and its blocks are freed as usual (on CUDA the step
still writing into them runs before any later step that reuses them: one stream). A placeholder is never hashed:
blocks are hashed over computed tokens only, and a placeholder is replaced before it counts as computed.

It runs only while every request that could be scheduled allows it (AsyncSteps.allows); otherwise the step in
flight is finished and the engine takes the synchronous step.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.config import EngineConfig
from shared.engine.kv_tiers import KVTiers
from shared.engine.model_runner import FedTokens, ModelRunner
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.engine.sampled_ids import SampledIds
from shared.engine.sampler import Sampler
from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.engine.sequence import Sequence
from shared.engine.step_rows import step_rows

# The id a sequence holds for its token still on the device; never a real id, so a read of it fails loudly.
PLACEHOLDER = -1


def async_wanted(c: EngineConfig) -> bool:
    """Whether an engine of config c schedules ahead: asked for (None: on CUDA), with one rank (the follower ranks
    replay rank 0's host inputs) and no speculative decoding (its drafts need the last token on the host)."""
    on = c.async_scheduling if c.async_scheduling is not None else c.device.startswith("cuda")
    return bool(on) and c.tensor_parallel_size == 1 and c.speculative_config is None


@dataclass
class Launched:
    """A step on its way: its plan, the sequences that sample in it, and their ids (None: nothing samples)."""

    plan: SchedulerOutput
    sampling: list[Sequence]
    sampled: SampledIds | None

    def result(self) -> list[tuple[int, TokenLogprobs | None]]:
        """(token, logprobs) per sampling sequence: waits for the device."""
        return self.sampled.result() if self.sampled is not None else []


def allows_async(seq: Sequence, captures_kv: bool) -> bool:
    """Whether seq can run a step ahead of its last token reaching the host: nothing it needs reads that token on
    the host before the next step (a grammar, penalties, bad words, drafts), and it computes no prompt logprobs
    and hands out no prompt KV (both read the step's results on the host)."""
    return seq.samples_ahead and seq.matcher is None and not captures_kv and not seq.spec_token_ids


class AsyncSteps:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, tiers: KVTiers,
                 observe: Callable[[int], None]) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.tiers = tiers
        self.observe = observe  # the engine's histogram of tokens per step
        self.in_flight: Launched | None = None

    def allows(self) -> bool:
        """Whether every request the next schedule could run allows async scheduling."""
        sch = self.scheduler
        capture = sch.outputs.capture_kv if sch.outputs is not None else {}
        return all(allows_async(s, s.request_id in capture) for queue in (sch.running, sch.waiting) for _, s in queue)

    def step(self) -> list[RequestOutput] | None:
        """One engine step; None: this step must be synchronous (nothing is in flight then)."""
        if not self.allows():
            return None if self.in_flight is None else self.drain()
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self.advance(prev)
        plan = self.scheduler.schedule()
        with self.tiers.step_spills():
            if not plan.is_empty:
                self.in_flight = self.launch(plan, prev)
            return self.finish(prev) if prev is not None else []

    def launch(self, plan: SchedulerOutput, prev: Launched | None) -> Launched:
        """Build and start the step (on CUDA nothing here waits for the device); its ids start home at once."""
        self.observe(plan.num_batched_tokens)
        r = step_rows(plan.scheduled)
        logits = self.runner.execute(plan.scheduled, r.rows, self._fed(plan, prev))
        sampled = None
        if r.rows:
            sampled = self.sampler.sample_on_device(logits[: len(r.rows)], r.sampling).copy_to_host()
        return Launched(plan, r.sampling, sampled)

    @staticmethod
    def _fed(plan: SchedulerOutput, prev: Launched | None) -> FedTokens | None:
        """The rows whose input is a token prev sampled: every placeholder the plan computes."""
        if prev is None or prev.sampled is None:
            return None
        where = {id(s): i for i, s in enumerate(prev.sampling)}
        rows, src = [], []
        for i, (seq, _) in enumerate(plan.scheduled):
            j = where.get(id(seq))
            if j is not None:
                assert seq.token_ids[seq.num_computed_tokens] == PLACEHOLDER, seq.request_id
                rows.append(i)
                src.append(j)
        return FedTokens(rows, src, prev.sampled.tokens) if rows else None

    def advance(self, prev: Launched) -> None:
        """prev's tokens are computed (as update_from_output counts them); its samples are placeholders."""
        for seq, n in prev.plan.scheduled:
            if seq.is_finished:  # finished or aborted since prev was launched
                continue
            seq.num_computed_tokens += n
            self.scheduler.bm.cache_full_blocks(seq)  # before the placeholder: never part of a hash
        for seq in prev.sampling:
            if not seq.is_finished:
                seq.token_ids.append(PLACEHOLDER)

    def finish(self, prev: Launched) -> list[RequestOutput]:
        """prev's ids on the host replace their placeholders: outputs, stops, frees."""
        sampled = prev.result()
        now = time.time()
        outs = []
        for seq, (token, lp) in zip(prev.sampling, sampled):
            if seq.is_finished:
                continue  # aborted before advance: it holds no placeholder
            assert seq.token_ids[-1] == PLACEHOLDER, seq.request_id
            seq.token_ids.pop()
            outs.append(self.scheduler.append_token(seq, token, lp, now))
        return outs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight as a synchronous step would (the next step is synchronous)."""
        prev, self.in_flight = self.in_flight, None
        assert prev is not None
        sampled = prev.result()
        live = SchedulerOutput([(s, n) for s, n in prev.plan.scheduled if not s.is_finished])
        rows = [(s, t, lp) for s, (t, lp) in zip(prev.sampling, sampled) if not s.is_finished]
        return self.scheduler.update_from_output(live, rows, time.time())
