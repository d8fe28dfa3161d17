"""Typed commands the engine thread runs between steps: what services may ask of an engine.

Each command is a small frozen dataclass whose `run(engine)` is the only code that touches the engine
for it. Commands about a held request are no-ops (returning False/None) when the request is no longer
held, because cancellation races with every step of an admission and losing that race is normal.
A command that produces a RequestOutput (a remote first token) has it delivered to the step callback
by the engine thread, so it reaches the event loop before any later step's tokens.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from shared.engine.llm_engine import EngineStats, LLMEngine, Reservation
from shared.engine.offload import BlockStore, OffloadBatch
from shared.engine.outputs import RequestOutput, TokenLogprobs
from shared.engine.tp.shard_link import ShardTarget
from shared.kv_blocks import KVBlocks
from shared.sampling_params import SamplingParams

T = TypeVar("T")


class Command(Generic[T]):
    delivers_output = False  # True: a RequestOutput it returns also goes to the step callback

    def run(self, engine: LLMEngine) -> T:
        raise NotImplementedError


@dataclass(frozen=True)
class Reserve(Command[Reservation | None]):
    """Admit without scheduling: prefix-cache match and blocks for the whole prompt (None: pool full now)."""

    request_id: str
    prompt_token_ids: Seq[int]
    params: SamplingParams
    priority: int = 0
    capture_kv_from_block: int | None = None
    # When fewer prompt tokens than this are left after the prefix cache, commit at once (computed here): the
    # caller knows nothing below the device could add to the prefix, and saves a second wait for the step
    # boundary (a command runs between steps). 0: never.
    commit_if_uncached_below: int = 0
    # The same for a caller with tiers below the device (host tier, kvstore), when the device cache already holds
    # every full block of the prompt: no tier could add to that prefix, so there is nothing to look up and the
    # second command (Commit after the lookup) would only wait for another step boundary. 0: never.
    commit_if_prefix_cached_below: int = 0
    # When the request reached the worker (None: now). A command waits for the step in progress to end; that
    # wait is the request's time in the worker's queue, as its timings report it.
    arrival_time: float | None = None

    def run(self, engine: LLMEngine) -> Reservation | None:
        res = engine.reserve(self.request_id, self.prompt_token_ids, self.params, self.priority,
                             arrival_time=self.arrival_time, capture_kv_from_block=self.capture_kv_from_block)
        if res is None:
            return None
        left = len(self.prompt_token_ids) - res.num_cached_tokens
        whole_prefix = res.num_cached_tokens // engine.config.block_size >= len(res.block_hashes)
        if left < self.commit_if_uncached_below or (whole_prefix and left < self.commit_if_prefix_cached_below):
            engine.commit_held(self.request_id, res.num_cached_tokens)
            return replace(res, committed=True)
        return res


@dataclass(frozen=True)
class Enqueue(Command[None]):
    """Queue a request to be computed here from scratch (its prefix cache still applies)."""

    request_id: str
    prompt_token_ids: Seq[int]
    params: SamplingParams
    priority: int = 0
    capture_kv_from_block: int | None = None
    arrival_time: float | None = None  # as Reserve's

    def run(self, engine: LLMEngine) -> None:
        engine.add_request(self.request_id, self.prompt_token_ids, self.params, self.priority,
                           arrival_time=self.arrival_time, capture_kv_from_block=self.capture_kv_from_block)


@dataclass(frozen=True)
class WriteBlocks(Command[bool]):
    """K/V of a held request's logical blocks; False when it is no longer held."""

    request_id: str
    blocks: KVBlocks

    def run(self, engine: LLMEngine) -> bool:
        if not engine.is_held(self.request_id):
            return False
        engine.write_blocks(self.request_id, self.blocks)
        return True


@dataclass(frozen=True)
class Commit(Command[RequestOutput | None]):
    """Hand a held request to the scheduler with its first num_computed_tokens in place (and, after a
    remote prefill, its first token)."""

    delivers_output = True
    request_id: str
    num_computed_tokens: int
    first_token: int | None = None
    logprobs: TokenLogprobs | None = None

    def run(self, engine: LLMEngine) -> RequestOutput | None:
        if not engine.is_held(self.request_id):
            return None
        return engine.commit_held(self.request_id, self.num_computed_tokens, self.first_token, self.logprobs)


@dataclass(frozen=True)
class Abort(Command[RequestOutput | None]):
    """Stop a request wherever it is (held, waiting or running) and free its blocks."""

    request_id: str

    def run(self, engine: LLMEngine) -> RequestOutput | None:
        return engine.abort(self.request_id)


@dataclass(frozen=True)
class Stats(Command[EngineStats]):
    def run(self, engine: LLMEngine) -> EngineStats:
        return engine.stats()


@dataclass(frozen=True)
class EvictAll(Command["OffloadBatch | None"]):
    """A worker leaving the mesh: every cached block not in use leaves the device pool and the host tier
    the way evictions do; returns those the store lacks, copied out for it (eviction policy)."""

    store: BlockStore

    def run(self, engine: LLMEngine) -> OffloadBatch | None:
        engine.tiers.evict_all()
        return engine.tiers.collect([], self.store, "eviction")


@dataclass(frozen=True)
class LearnOutputs(Command[int]):
    """Other decode workers' finished outputs, (cache salt, output tokens) each, join the worker-wide suffix
    table (shared suffix decoding); returns how many were learned (0 without a suffix proposer)."""

    outputs: tuple[tuple[str | None, tuple[int, ...]], ...]

    def run(self, engine: LLMEngine) -> int:
        spec = engine.speculator
        if spec is None:
            return 0
        return sum(spec.learn_output(salt, list(tokens)) for salt, tokens in self.outputs)


# --- rank-to-rank KV between tensor-parallel workers of one degree (shared/engine/tp/shard_link.py) ---------


@dataclass(frozen=True)
class ListenKVRanks(Command[list[int]]):
    """Open a KV receiver on each follower rank, on host: their ports, rank 1 first ([] for one process)."""

    host: str

    def run(self, engine: LLMEngine) -> list[int]:
        return engine.runner.listen_shards(self.host) if engine.tp is not None else []


@dataclass(frozen=True)
class ExpectShards(Command[bool]):
    """A held request's logical blocks from first_block on may arrive rank by rank for this transfer."""

    request_id: str
    transfer_id: str
    token: bytes
    first_block: int
    deadline_s: float

    def run(self, engine: LLMEngine) -> bool:
        if not engine.is_held(self.request_id) or engine.tp is None:
            return False
        ids = engine.scheduler.held[self.request_id].block_table[self.first_block:]
        engine.runner.expect_shards(self.transfer_id, self.token, ids, self.first_block, self.deadline_s)
        return True


@dataclass(frozen=True)
class ForgetShards(Command[None]):
    """The transfer is over (done, failed or cancelled): its late frames are refused on every rank. Run before
    its blocks can be reused (an Abort, or a local recompute)."""

    transfer_id: str

    def run(self, engine: LLMEngine) -> None:
        if engine.tp is not None:
            engine.runner.forget_shards(self.transfer_id)


@dataclass(frozen=True)
class RouteKVByRank(Command[bool]):
    """Before a prefill-only request is queued: its KV leaves rank by rank for `target` (a ShardTarget) when the
    receiver has as many ranks as this engine; False (whole blocks) otherwise."""

    request_id: str
    target: ShardTarget

    def run(self, engine: LLMEngine) -> bool:
        ranks = engine.tp.size if engine.tp is not None else 1
        if ranks == 1 or len(self.target.rank_endpoints) != ranks - 1:
            return False
        engine.scheduler.outputs.route_by_rank(self.request_id, self.target, engine.runner.send_shards,
                                               engine.runner.abandon_shards)
        return True
