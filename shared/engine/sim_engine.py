"""A simulated engine (`--engine sim`): the real engine with the model's forward pass replaced by a wait.

Everything around the forward is the real code: the scheduler (continuous batching, chunked prefill,
preemption, held requests), the block manager and its prefix cache, the KV tiers' bookkeeping, the
output processor (stop conditions, prompt KV capture for pushes). What a step computes is timed by a
cost model (shared/engine/sim_profile.py) and the step sleeps that long; the sampled tokens are a
deterministic function of the sequence (sim_token below), so a test can check them end to end, and
a request that migrates to another worker goes on with the same tokens. KV blocks hold placeholders
(shared/engine/kv_placeholder.py) that a real engine refuses. No weights load and no tensor of model
size exists: a worker costs a few MB and almost no CPU, so a 2-core machine hosts a large mesh.

For scale tests and planner evaluation only: never in a correctness test of the real engine.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from functools import partial
from pathlib import Path

import torch

from shared.block_hash import root_hash
from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.engine.kv_placeholder import PLACEHOLDER_DTYPE, placeholder_kv
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput
from shared.engine.sampler import Sampler
from shared.engine.scheduler import SchedulerOutput
from shared.engine.sim_profile import CostModel, StepShape
from shared.models.model_config import load_model_config
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Sampled tokens stay in a range every tokenizer decodes (above the usual special tokens, below the
# smallest common vocabulary), so the gateway's detokenizer sees ordinary text.
TOKEN_LOW, TOKEN_HIGH = 256, 32000
SIM_KV_KIND = "sim-placeholder"  # in the hash root: a simulated worker's blocks never share a hash with real ones


def sim_token(prev: int, position: int, vocab_size: int, stop_ids: Seq[int] = ()) -> int:
    """The token a simulated engine samples at `position` after token `prev`: a hash of the two, so the
    same sequence gives the same tokens on any worker (and after a migration, whose prompt ends with the
    tokens streamed so far). Never a stop token: outputs run to max_tokens."""
    x = (prev * 0x9E3779B1 + position * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    high = min(TOKEN_HIGH, vocab_size)
    low = TOKEN_LOW if high > 2 * TOKEN_LOW else 0  # a tiny test vocabulary: all of it
    t = low + x % (high - low)
    while t in stop_ids:
        t = low + (t + 1 - low) % (high - low)
    return t


def expected_tokens(prompt: Seq[int], n: int, vocab_size: int, stop_ids: Seq[int] = ()) -> list[int]:
    """The n tokens a simulated engine generates after `prompt` (what an end-to-end test checks)."""
    out: list[int] = []
    prev, pos = prompt[-1], len(prompt)
    for _ in range(n):
        prev = sim_token(prev, pos, vocab_size, stop_ids)
        out.append(prev)
        pos += 1
    return out


class SimRunner:
    """The model runner's KV surface without a KV pool: reads give placeholders of the right block count,
    writes check the block count and the placeholder flag."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # What the worker's load beat reads the KV dtype from.
        self.kv_caches = [(torch.empty(0, dtype=PLACEHOLDER_DTYPE), torch.empty(0, dtype=PLACEHOLDER_DTYPE))]

    def gather_blocks(self, block_ids: Seq[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return placeholder_kv(len(block_ids), self.block_size)

    read_blocks = gather_blocks

    def write_blocks(self, block_ids: Seq[int], k: torch.Tensor, v: torch.Tensor, first_layer: int = 0) -> None:
        if k.dtype != PLACEHOLDER_DTYPE or v.dtype != PLACEHOLDER_DTYPE:
            raise ValueError(f"a simulated engine holds placeholder KV only; got {k.dtype} blocks")
        if k.shape[1] != len(block_ids) or v.shape[1] != len(block_ids):
            raise ValueError(f"{k.shape[1]} KV blocks for {len(block_ids)} block ids")


class SimExecutor:
    """The executor of a simulated engine (shared/engine/executor.py says what an executor provides): the
    model's config alone, no weights; a step's forward is a wait of the cost model's length."""

    model = None  # no weights load
    tp = draft = None  # one process, no ranks; no draft model
    async_copies = can_overlap = False  # a simulated step has no device to copy beside or overlap with

    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        c = config
        if c.speculative_config is not None:
            raise ConfigError("--speculative-config: the simulated engine (--engine sim) has no model to verify drafts "
                              "with; leave it out")
        self.cost = cost
        self.model_config = mc = load_model_config(c.model)  # the config alone: no weights
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        self.dtype = self.kv_dtype = PLACEHOLDER_DTYPE
        self.runner = SimRunner(c.block_size)
        self.sampler = Sampler(mc.eos_token_ids, c.seed, "cpu")
        # The KV capacity is the profiled worker's (a GPU's, for a GPU profile), not this machine's.
        self.num_blocks = c.num_kv_blocks or max(1, cost.profile.kv_tokens // c.block_size)
        model_id = c.model_id or Path(c.model).resolve().name
        self.block_root = root_hash(model_id, c.block_size, SIM_KV_KIND, c.cache_salt)
        self.busy_s = 0.0  # simulated compute time so far
        self.num_steps = 0
        log.info("SIMULATED engine (--engine sim, profile %r, speed x%g): %d KV blocks of %d tokens; no model runs",
                 cost.profile.name, cost.speed, self.num_blocks, c.block_size)

    def check(self, params: SamplingParams) -> None:
        # What the simulation cannot produce is refused, never silently left out of the output.
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs: a simulated engine worker (--engine sim) computes no logprobs")
        if params.structured is not None:
            raise ValueError("structured outputs: a simulated engine worker (--engine sim) does not constrain "
                             "its tokens")

    def run(self, engine: LLMEngine, plan: SchedulerOutput) -> list[RequestOutput]:
        if plan.is_empty:
            return []
        t0 = time.perf_counter()
        engine.iteration_tokens.observe(plan.num_batched_tokens)
        cost = self.cost.step_s(step_shape(plan))
        vocab = self.model_config.vocab_size
        sampled = []
        for seq, n in plan.scheduled:
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled.append((seq, sim_token(seq.token_ids[-1], seq.num_tokens, vocab, self.sampler.stop_ids(seq)),
                                None))
        left = cost - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)  # the forward pass this step stands for
        self.busy_s += cost
        self.num_steps += 1
        return engine.scheduler.update_from_output(plan, sampled, time.time())

    def shutdown(self) -> None:
        """Nothing to stop: no follower ranks."""


def step_shape(plan: SchedulerOutput) -> StepShape:
    """What the cost model prices in a plan: prompt tokens and their attention span, decode rows and theirs."""
    pt = pa = ds = dc = 0
    for seq, n in plan.scheduled:
        start = seq.num_computed_tokens
        if n > 1 or start < seq.num_prompt_tokens:  # a prompt chunk (or a recompute after preemption)
            pt += n
            pa += n * (start + n // 2)
        else:
            ds += 1
            dc += start + n
    return StepShape(pt, pa, ds, dc)


class SimEngine(LLMEngine):
    """The real engine built by its own constructor around a SimExecutor."""

    shape = staticmethod(step_shape)

    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        super().__init__(config, partial(SimExecutor, cost=cost))
