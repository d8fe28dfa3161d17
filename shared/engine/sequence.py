"""A request inside the engine: its tokens, progress counters and the blocks it holds."""
from __future__ import annotations

import enum
import itertools
import time

from typing import Any

import torch

from shared.block_hash import BlockHash
from shared.engine.outputs import TokenLogprobs
from shared.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    HELD = "held"  # blocks reserved, waiting for its KV from elsewhere (a prefill worker, the kvstore)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                 arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        # Read once (params are frozen): the sampler asks this of every row every step, and a pydantic
        # model's attribute reads cost about three times a plain object's (its __getattr__ keeps CPython
        # from specializing them): ~50 us a step at 256 greedy rows otherwise.
        self.plain_greedy = (params.greedy and params.logprobs is None and not params.uses_penalties
                             and not params.logit_bias and params.allowed_token_ids is None
                             and not params.bad_words_ids)
        self.min_tokens = params.min_tokens
        # Whether sampling reads none of the output's tokens on the host and the step no prompt logits, so async
        # scheduling (shared/engine/async_step.py) may run a step before the last token is there; read every step.
        self.samples_ahead = not params.uses_penalties and not params.bad_words_ids and params.prompt_logprobs is None
        self.priority = priority
        self.arrival_order = next(_arrivals)  # FIFO tie-break that survives preemption
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at (last) admission
        self.block_table: list[int] = []
        self.block_hashes: list[BlockHash] = []  # hashes of the leading full blocks, filled lazily
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] = []  # filled as prompt chunks run
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        # A seeded request's own generator keeps its samples independent of the batch it runs in; the
        # sampler creates it on its device the first time the request samples.
        self.generator: torch.Generator | None = None
        self.matcher: Any = None  # xgrammar GrammarMatcher of a structured-output request
        # Whether the structured constraint is on: at once, or once the output wrote params.reasoning_end_ids.
        self.reasoning_over = not params.reasoning_end_ids
        # Speculative decoding (shared/engine/spec/): tokens proposed for this step's verify, never part of
        # token_ids (so never hashed, cached or sent) until the verify accepts them; the proposer's per-request
        # index of the context, and the adaptive draft length (shared/engine/spec/adaptive.py).
        self.spec_token_ids: list[int] = []
        self.spec_index: Any = None
        self.spec_budget: Any = None
        # A draft model's distributions q the drafts were drawn from ([len(spec_token_ids), vocab], on the device),
        # for the rejection sampler; None: point-mass drafts (a lookup proposer, or a greedy request).
        self.spec_draft_probs: torch.Tensor | None = None
        # The LoRA adapter this request computes with (shared/engine/lora_manager.py Adapter; None: the base model),
        # bound at admission: unloading its name later does not change what a running request computes.
        self.lora: Any = None

    @property
    def lora_digest(self) -> str | None:
        """The adapter's identity in the block hashes (None: the base model)."""
        return self.lora.digest if self.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int]:
        """Admission order: higher priority first, FIFO within a priority."""
        return (-self.priority, self.arrival_order)
