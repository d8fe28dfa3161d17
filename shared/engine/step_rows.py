"""Which rows of a step's forward the engine reads, from the scheduler's plan.

A step computes n tokens of each scheduled sequence, their rows laid out in turn. A sequence whose n tokens
bring it up to all its tokens samples one token, at its last row. One that computes more than that is verifying
k drafts (shared/engine/spec/): all its last k + 1 rows are read. One still inside its prompt reads nothing,
unless it asked for prompt logprobs (shared/engine/prompt_logprobs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.engine.prompt_logprobs import prompt_logprob_rows
from shared.engine.sequence import Sequence


@dataclass
class StepRows:
    sampling: list[Sequence]  # sequences that sample one token ...
    rows: list[int]  # ... at these rows, in the same order
    drafts: list[tuple[Sequence, int]]  # (sequence, k drafts it verifies) ...
    spec_rows: list[int]  # ... and each one's k + 1 rows in turn
    prompt_rows: list[tuple[int, Sequence, int]]  # (row, sequence, prompt token it predicts)


def step_rows(scheduled: list[tuple[Sequence, int]]) -> StepRows:
    out = StepRows([], [], [], [], [])
    last_rows, last = [], -1
    for seq, n in scheduled:
        last += n
        last_rows.append(last)
        beyond = seq.num_computed_tokens + n - seq.num_tokens  # drafts verified when > 0; < 0: mid-prompt
        if beyond == 0:
            out.sampling.append(seq)
            out.rows.append(last)
        elif beyond > 0:
            out.drafts.append((seq, beyond))
            out.spec_rows.extend(range(last - beyond, last + 1))
    out.prompt_rows = prompt_logprob_rows(scheduled, last_rows)
    return out
