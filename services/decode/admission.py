"""One request's way into this decode worker's engine, as an explicit state machine.

    RECEIVED --reserve--> RESERVED --kvstore--> FETCHED --(long tail)--> REMOTE --KV + first token--> RUNNING
        |                    |                     |                       |
        | (pool full)        |                     +--(short tail)---------+--(failure: local)-----> RUNNING
        v                    |
      QUEUED (computed here once blocks free up)
    any state --cancel--> CANCELLED (blocks freed, transfer forgotten, prefill worker told)
    RECEIVED --invalid--> FAILED (400 to the client)

The Admission owns everything the request holds while it is admitted: the reservation of blocks, the
kvstore fetch, the remote prefill (transfer id, the prefill worker's work) and its cancellation. It
talks to the engine only with typed commands (shared/engine/commands.py). Whatever fails on the
remote path (no prefill worker, timeout, bad transfer) falls back to computing locally, so the output
never changes.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.engine.commands import Abort, Commit, Enqueue, ExpectShards, ForgetShards, Reserve, WriteBlocks
from shared.engine.engine_thread import EngineStopped, EngineThread
from shared.engine.llm_engine import Reservation
from shared.kv_transport import NatsKVTransport, TransferError
from shared.kv_blocks import KVBlocks
from shared.protocol import errors as codes
from shared.protocol.generate import CancelRequest, GenerateRequest
from shared.protocol.prefill import RemotePrefillReply, RemotePrefillRequest

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.decode")


# A prompt whose prefill worker lost a rank is asked of the queue group once more before it is computed here.
PREFILL_ATTEMPTS = 2


class State(enum.Enum):
    RECEIVED = "received"
    RESERVED = "reserved"
    FETCHED = "fetched"  # the kvstore's chain (if any) is in the reservation
    REMOTE = "remote_prefill"
    QUEUED = "queued_local"
    RUNNING = "running"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class AdmissionSettings:
    worker_id: str
    block_size: int
    remote_prefill_threshold: int
    remote_prefill_timeout_s: float
    kv_transfer_timeout_s: float
    remote_prefill_timeout_per_token_s: float = 0.0
    # No host tier and no kvstore: nothing below the device pool can add to a prompt's prefix, so a prompt
    # that stays local is committed by its Reserve command (one engine round trip, not two).
    nothing_below_device: bool = False


class Host(Protocol):
    """What an admission needs from its worker."""

    nc: Client
    thread: EngineThread
    transport: NatsKVTransport
    kv_rank_endpoints: list[str]  # a tensor-parallel worker's ranks 1..N-1 direct KV channels ([]: none)

    async def load_prefix(self, rid: str, res: Reservation) -> int: ...

    async def reject(self, admission: Admission, message: str, code: str = codes.BAD_REQUEST) -> None: ...

    def admitted(self, admission: Admission) -> None: ...


class PrefillMoved(TransferError):
    """The prefill worker lost a tensor-parallel rank and answered MOVE_ELSEWHERE: another may take the prompt."""


class InvalidRequest(Exception):
    """The engine refused the request (a 400 for the client)."""


class Admission:
    def __init__(self, req: GenerateRequest, host: Host, settings: AdmissionSettings, span: trace.Span) -> None:
        self.req = req
        self.rid = req.request_id
        self.host = host
        self.settings = settings
        self.span = span
        self.state = State.RECEIVED
        self.arrival_time = time.time()  # the worker's queue time starts here (RequestTimings.queued_s)
        self.reservation: Reservation | None = None
        self.num_cached_tokens = 0
        self.transfer_id: str | None = None
        self.by_rank = False  # the transfer in flight may arrive rank by rank (followers hold its blocks' ids)
        self.went_remote = False
        self.fell_back = False
        self.prefill_moves = 0  # remote prefills asked again after their prefill worker lost a rank
        self._task: asyncio.Task | None = None

    # --- driving ------------------------------------------------------------------------------------

    def start(self) -> asyncio.Task:
        self._task = asyncio.ensure_future(self._run())
        return self._task

    async def _run(self) -> None:
        try:
            await self._admit()
        except InvalidRequest as e:
            await self.host.reject(self, str(e))
            return
        except EngineStopped:
            # The worker is going down (its engine crashed or it is shutting down): what fails or
            # migrates its requests is the crash handling and the gateway, not this admission.
            self.state = State.FAILED
            return
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the client waiting on a silent task
            log.exception("admission of %s failed", self.rid)
            await self._fail_internal(f"{type(e).__name__}: {e}")
            return
        self.host.admitted(self)

    async def _fail_internal(self, message: str) -> None:
        """An unexpected failure: whatever the request holds is given up (as a cancel would) and the client gets
        an internal error at once instead of waiting for its timeout."""
        try:
            await self.cancel("admission failed")
        except Exception:  # noqa: BLE001 - the reply below matters more than a second failure
            log.exception("releasing %s after its failed admission", self.rid)
        self.state = State.FAILED
        await self.host.reject(self, f"decode admission failed: {message}", codes.INTERNAL)

    async def _admit(self) -> None:
        req, rid, host = self.req, self.rid, self.host
        params = req.sampling
        here = params.prompt_logprobs is not None  # prompt logprobs need every prompt position computed here
        s = self.settings
        # Each engine command waits for the step in progress to end: a local prompt committed by Reserve itself
        # starts a step sooner (`kvmesh bench scale` measured ~0.7 of a step of TTFT for the second round trip).
        # With tiers below the device that holds for a prompt whose every full block is in the device cache (a
        # chat template's shared prefix, a conversation's next turn): the tiers have nothing to add to it.
        commit_below = len(req.prompt_token_ids) + 1 if here else (
            s.remote_prefill_threshold if s.nothing_below_device else 0)
        with _tracer.start_as_current_span("decode.admit", context=trace.set_span_in_context(self.span)) as span:
            try:
                res = await host.thread.run(Reserve(rid, req.prompt_token_ids, params, req.priority,
                                                    commit_if_uncached_below=commit_below,
                                                    commit_if_prefix_cached_below=s.remote_prefill_threshold,
                                                    arrival_time=self.arrival_time))
            except ValueError as e:
                self.state = State.FAILED
                raise InvalidRequest(str(e)) from None
            if self.state is State.CANCELLED:  # cancelled while reserving: the reservation goes too
                await host.thread.run(Abort(rid))
                return
            if res is None:  # the pool is full right now: queue it like any local request
                await host.thread.run(Enqueue(rid, req.prompt_token_ids, params, req.priority,
                                              arrival_time=self.arrival_time))
                self.state = State.QUEUED
                span.set_attribute("kvmesh.prefill", "local-queued")
                return
            if res.committed:
                self.reservation, self.num_cached_tokens, self.state = res, res.num_cached_tokens, State.RUNNING
                span.set_attribute("kvmesh.cached_tokens", res.num_cached_tokens)
                span.set_attribute("kvmesh.prefill", "local")
                return
            self.reservation, self.state = res, State.RESERVED
            # Prompt logprobs need the logits of every prompt position: computed here, nothing fetched.
            cached = res.num_cached_tokens if here else await host.load_prefix(rid, res)
            if self.state is State.CANCELLED:
                return
            self.num_cached_tokens, self.state = cached, State.FETCHED
            span.set_attribute("kvmesh.cached_tokens", cached)
            remote = len(req.prompt_token_ids) - cached >= self.settings.remote_prefill_threshold and not here
            span.set_attribute("kvmesh.prefill", "remote" if remote else "local")
        if remote and await self._remote_prefill(res, cached):
            return
        if self.state is not State.CANCELLED:
            await host.thread.run(Commit(rid, cached))
            self.state = State.RUNNING

    async def _remote_prefill(self, res: Reservation, cached: int) -> bool:
        """True when the prompt's KV arrived and the first token was emitted; False to compute locally.

        A prefill worker that lost a tensor-parallel rank answers MOVE_ELSEWHERE at once: the prompt is asked of
        the prefill queue group again (another worker, the failed one refuses while it drains), as a decode
        worker's streams move; a second failure computes locally as any other does."""
        for attempt in range(PREFILL_ATTEMPTS):
            moved = await self._remote_prefill_once(res, cached, last=attempt == PREFILL_ATTEMPTS - 1)
            if moved is not None:
                return moved
            self.prefill_moves += 1
        return False  # pragma: no cover - the last attempt never asks to move

    async def _remote_prefill_once(self, res: Reservation, cached: int, last: bool) -> bool | None:
        """One prefill worker's attempt; None when it asked the prompt to move elsewhere (and not `last`)."""
        rid, req, host, s = self.rid, self.req, self.host, self.settings
        first_block = cached // s.block_size
        self.transfer_id = transfer_id = uuid.uuid4().hex
        self.state, self.went_remote = State.REMOTE, True

        async def write(blocks: KVBlocks) -> None:
            if not await host.thread.run(WriteBlocks(rid, blocks)):
                raise TransferError("request is no longer waiting for KV")

        endpoint = host.transport.endpoint
        token = secrets.token_bytes(16) if endpoint else b""  # only the prefill worker we ask learns it
        done = host.transport.expect(transfer_id, res.num_blocks, write, s.kv_transfer_timeout_s, token=token)
        # Rank by rank when a prefill worker of this degree takes it: every rank learns where its shards go first.
        self.by_rank = bool(token and host.kv_rank_endpoints) and await host.thread.run(
            ExpectShards(rid, transfer_id, token, first_block, s.kv_transfer_timeout_s))
        msg = RemotePrefillRequest(request_id=rid, transfer_id=transfer_id, prompt_token_ids=req.prompt_token_ids,
                                   num_cached_tokens=cached, decode_worker_id=s.worker_id,
                                   num_dest_blocks=res.num_blocks - first_block, block_size=s.block_size,
                                   sampling=req.sampling, kv_endpoint=endpoint, kv_token=token,
                                   kv_rank_endpoints=host.kv_rank_endpoints if self.by_rank else [])
        with _tracer.start_as_current_span("decode.remote_prefill", context=trace.set_span_in_context(self.span),
                                           attributes={"kvmesh.transfer_id": transfer_id}) as span:
            try:
                deadline = s.remote_prefill_timeout_s + s.remote_prefill_timeout_per_token_s * (
                    len(req.prompt_token_ids) - cached)
                reply = await bus.request(host.nc, subjects.PREFILL_PREFILL, msg, timeout=deadline,
                                          expect=RemotePrefillReply)
                if reply.request_id != rid or reply.transfer_id != transfer_id:
                    # Not the answer to this request: one steered here (another requester can name this inbox
                    # as the reply of its own request). Its first token is not taken; the prompt is computed here.
                    raise TransferError(f"a prefill reply for {reply.request_id}/{reply.transfer_id} came to "
                                        f"{rid}/{transfer_id}'s inbox")
                if reply.error is not None or reply.first_token_id is None:
                    error = PrefillMoved if reply.error == codes.MOVE_ELSEWHERE else TransferError
                    raise error(f"prefill worker failed: {reply.error}")
                await asyncio.wait_for(done, timeout=s.kv_transfer_timeout_s)
            except (bus.BusError, TransferError, asyncio.TimeoutError, asyncio.CancelledError) as e:
                host.transport.forget(transfer_id)
                if not done.done():
                    done.cancel()
                if not isinstance(e, asyncio.CancelledError):  # a cancel forgets it before its Abort
                    await self._forget_shards()
                self.transfer_id = None
                span.set_attribute("kvmesh.fallback", str(e) or type(e).__name__)
                if isinstance(e, PrefillMoved) and not last and self.state is not State.CANCELLED:
                    # No cancel: the failed worker's engine is gone, and a cancel of this request id could
                    # overtake the next attempt (another subject) at the worker that takes it.
                    log.warning("prefill worker of %s lost a rank; asking another", rid)
                    return None
                await bus.publish(host.nc, subjects.PREFILL_CANCEL, CancelRequest(request_id=rid, reason="fallback"))
                if isinstance(e, asyncio.CancelledError):
                    raise
                log.warning("remote prefill of %s failed (%s); computing locally", rid, e or type(e).__name__)
                self.fell_back = True
                return False
        await self._forget_shards()
        self.transfer_id = None
        if self.state is State.CANCELLED:
            return True
        # The prompt tokens served from a cache are those the prefill worker found too (its device pool,
        # host tier or the kvstore), not only this worker's: usage's cached_tokens counts every tier.
        self.num_cached_tokens = max(self.num_cached_tokens, reply.num_cached_tokens)
        lp = reply.logprobs.to_engine() if reply.logprobs is not None else None
        await host.thread.run(Commit(rid, len(req.prompt_token_ids), reply.first_token_id, lp))
        self.state = State.RUNNING
        return True

    async def _forget_shards(self) -> None:
        """The transfer's blocks stop taking shards on every rank (a no-op unless it went rank by rank)."""
        if self.by_rank and self.transfer_id is not None:
            self.by_rank = False
            await self.host.thread.run(ForgetShards(self.transfer_id))

    # --- cancellation -------------------------------------------------------------------------------

    async def cancel(self, reason: str) -> None:
        """Give up the request wherever its admission is: blocks, the transfer, the prefill worker's work."""
        if self.state in (State.CANCELLED, State.FAILED):
            return
        self.state = State.CANCELLED
        await self._forget_shards()  # before the Abort frees the blocks: no rank writes into them after
        await self.host.thread.run(Abort(self.rid))
        if self.transfer_id is not None:
            self.host.transport.forget(self.transfer_id)
            await bus.publish(self.host.nc, subjects.PREFILL_CANCEL, CancelRequest(request_id=self.rid, reason=reason))
        if self._task is not None and not self._task.done() and self._task is not asyncio.current_task():
            self._task.cancel()

