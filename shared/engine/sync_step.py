"""The synchronous step: run a plan, sample, verify drafts, and hand the host's ids to the scheduler.

Every request kind runs here (structured outputs, penalties, prompt logprobs, speculative decoding); the
overlapped step (shared/engine/async_step.py) takes over only while every request allows it.
"""
from __future__ import annotations

import time

from shared.engine.outputs import RequestOutput
from shared.engine.prompt_logprobs import record_prompt_logprobs
from shared.engine.scheduler import SchedulerOutput
from shared.engine.spec.grammar_drafts import draft_bitmask
from shared.engine.step_parts import StepParts
from shared.engine.step_rows import step_rows


def run_plan(engine: StepParts, plan: SchedulerOutput) -> list[RequestOutput]:
    if plan.is_empty:
        return []
    e = engine
    e.iteration_tokens.observe(plan.num_batched_tokens)
    r = step_rows(plan.scheduled)  # logits rows: the sampling ones, then the verifying ones
    if r.prompt_rows:
        logits, hidden = e.runner.execute_rows(plan.scheduled, r.rows + r.spec_rows, [i for i, _, _ in r.prompt_rows])
        record_prompt_logprobs(e.runner.prompt_logits, hidden, r.prompt_rows)
    else:  # decode graphs where the plan allows
        logits = e.runner.execute(plan.scheduled, r.rows + r.spec_rows)
    # On CUDA the forward is still running here: the grammar masks are filled on the host meanwhile.
    matchers = [s.matcher if s.reasoning_over else None for s in r.sampling]  # none while a model still reasons
    bitmask = e.grammar().token_bitmask(matchers) if any(m is not None for m in matchers) else None
    samples = e.sampler.sample(logits[: len(r.rows)], r.sampling, token_bitmask=bitmask) if r.rows else []
    sampled = [(seq, token, lp) for seq, (token, lp) in zip(r.sampling, samples)]
    verified = []
    if r.drafts:
        # The grammar's mask at every drafted position: only structured requests touch xgrammar.
        spec_mask = draft_bitmask(lambda n: e.grammar().allocate(n), r.drafts)
        verified = e.speculator.verify(e.sampler, logits[len(r.rows) :], r.drafts, spec_mask)
    outs = e.scheduler.update_from_output(plan, sampled, time.time(), verified)
    if e.speculator is not None:
        e.speculator.observe_finished(r.sampling + [s for s, _ in r.drafts])
    return outs
