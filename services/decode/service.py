"""Decode worker: runs the engine with continuous batching and streams tokens to the gateway.

This module is the worker's lifecycle and its endpoints; each request's way into the engine is an
Admission (admission.py: reservation, kvstore fetch, remote prefill, cancellation as explicit states),
the requests in flight live in a RequestTable (requests.py) and everything sent goes through one
ordered Outbox (outbox.py).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass

from nats.aio.client import Client
from opentelemetry import trace

from shared import bus, subjects
from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.engine.commands import ListenKVRanks
from shared.engine.outputs import RequestOutput
from shared.engine.tp.launch import TPRankError
from shared.protocol import errors as codes
from shared.protocol.errors import ErrorReply
from shared.protocol.events import LoadBeat
from shared.protocol.generate import CancelRequest, GenerateRequest, ReplayRequest, TokenChunk, TokenLogprob
from services.decode.admission import Admission, AdmissionSettings, State
from services.decode.outbox import Delivery, Outbox
from services.decode.replay import ReplayBuffer
from services.decode.requests import DecodeRequest, RequestTable
from services.decode.suffix_sharing import SuffixSharing
from services.engine_worker import EngineWorker, default_worker_id, request_timings, to_wire
from services.engine_args import add_engine_arguments, engine_config_from_args, engine_factory_from_args

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("kvmesh.decode")
VERSION = "0.1.0"


# Seconds per uncached prompt token a remote prefill may take before decode gives up on it and prefills
# locally. A GPU prefills thousands of tokens a second; a 2-core CPU computes SmolLM2-135M's 4,096-token prompt
# at about 5 ms a token, so there the GPU's bound sent every long prompt to a timeout and then a second, local
# prefill. The bound is also what a dead prefill worker costs, so it is not made larger than that: bigger models
# on CPUs want --remote-prefill-timeout-per-token.
GPU_PREFILL_S_PER_TOKEN = 0.002
CPU_PREFILL_S_PER_TOKEN = 0.02


def default_prefill_timeout_per_token(device: str) -> float:
    return CPU_PREFILL_S_PER_TOKEN if device == "cpu" else GPU_PREFILL_S_PER_TOKEN


@dataclass
class DecodeSettings:
    worker_id: str
    remote_prefill_threshold: int = 512  # uncached prompt tokens at which prefill goes remote; 0 = always
    use_kvstore: bool = True
    # A remote prefill must answer within base + per-token x uncached tokens, or decode computes locally:
    # a dead (or stuck) prefill worker costs about two seconds, a long prompt gets the time it needs.
    remote_prefill_timeout_s: float = 2.0
    remote_prefill_timeout_per_token_s: float | None = None  # None: by the engine's device
    kv_transfer_timeout_s: float = 30.0
    beat_interval_s: float = 1.0
    kv_host: str | None = None  # the direct KV channel's address (None: the one this worker reaches NATS from)
    direct_kv: bool = True  # False: prefill workers push KV over NATS only
    # Suffix speculation: publish finished outputs to the other decode workers and learn theirs
    # (suffix_sharing.py). Only where the speculative method is suffix. Off by default: measured on SmolLM2 it
    # saves 1-4% of decode steps (`kvmesh bench spec-shared`) while each worker's engine
    # thread counts every peer's outputs too.
    share_suffix_outputs: bool = False
    # Tensor-parallel: a prefill worker of the same degree sends each rank's KV heads to the matching rank here
    # (False: whole blocks through rank 0, gathered there and scattered here, as between different degrees).
    rank_kv: bool = True


class DecodeService(EngineWorker):
    name = "decode"
    role = "decode"

    def __init__(self, engine_config: EngineConfig, settings: DecodeSettings) -> None:
        super().__init__(engine_config, settings.use_kvstore, settings.worker_id, settings.beat_interval_s)
        spec = engine_config.speculative_config
        if settings.share_suffix_outputs and (spec is None or spec.method != "suffix"):
            raise ConfigError("--share-suffix-outputs needs suffix speculation "
                              "(--speculative-config '{\"method\": \"suffix\"}')")
        self.settings = settings
        self.kv_host, self.direct_kv = settings.kv_host, settings.direct_kv
        self.requests = RequestTable()
        self.replay = ReplayBuffer()  # recent chunks per stream, for a gateway that lost some (replay.py)
        self.draining = False
        self.num_received = 0  # generate requests that reached this worker
        self.num_cancels = 0  # cancel messages seen (for any request)
        self.remote_prefills = 0  # prompts whose KV came from a prefill worker
        self.remote_fallbacks = 0  # remote attempts that ended in a local recompute
        self.prefill_moves = 0  # remote prefills asked of another prefill worker after theirs lost a rank
        self.queued_local = 0  # admitted while the KV pool was full: prefilled here once blocks free up
        self.suffix_sharing: SuffixSharing | None = None
        self.kv_rank_endpoints: list[str] = []  # this worker's ranks 1..N-1 direct KV channels (tensor parallel)
        self._aborting: set[asyncio.Task] = set()  # aborts of cancelled requests on their way to the engine

    @property
    def active(self) -> dict[str, DecodeRequest]:
        return self.requests.active

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self, nc: Client) -> None:
        bus.set_sender(nc, self.settings.worker_id)  # the gateway accepts a request's stream only from its worker
        await self.start_engine(nc)
        s = self.settings
        per_token = s.remote_prefill_timeout_per_token_s
        if per_token is None:
            per_token = default_prefill_timeout_per_token(self.engine.config.device)
        self.admission_settings = AdmissionSettings(s.worker_id, self.block_size, s.remote_prefill_threshold,
                                                    s.remote_prefill_timeout_s, s.kv_transfer_timeout_s, per_token,
                                                    nothing_below_device=self.kvstore is None
                                                    and not self.engine.config.host_kv_bytes)
        self.outbox = Outbox(nc, subjects.decode_events(s.worker_id))
        if s.share_suffix_outputs:
            self.suffix_sharing = SuffixSharing(nc, s.worker_id, self.engine.block_manager.root, self.thread)
            await self.suffix_sharing.start()
        await self.transport.start(s.worker_id)
        server = getattr(self.transport, "server", None)  # the direct channel (MeshKVTransport), when there is one
        if s.rank_kv and server is not None and self.engine.config.tensor_parallel_size > 1:
            ports = await self.thread.run(ListenKVRanks(server.host))
            host = f"[{server.host}]" if ":" in server.host else server.host
            self.kv_rank_endpoints = [f"tcp://{host}:{port}" for port in ports]
        self.cancel_sub = await bus.subscribe(nc, subjects.DECODE_CANCEL, self._on_cancel, CancelRequest)
        # Not a micro endpoint: it must go on answering while the worker drains (stop_intake stops those).
        self.replay_served = await bus.serve(nc, subjects.decode_replay(s.worker_id),
                                             f"{subjects.QUEUE_DECODE}.{s.worker_id}", self._on_replay, ReplayRequest)
        self.micro = await bus.add_micro_service(nc, subjects.SERVICE_DECODE, VERSION, [
            bus.Endpoint("generate", subjects.DECODE_GENERATE, subjects.QUEUE_DECODE, self._on_generate,
                         GenerateRequest),
            bus.Endpoint("generate_worker", subjects.decode_generate(s.worker_id), f"{subjects.QUEUE_DECODE}.{s.worker_id}",
                         self._on_generate, GenerateRequest),
        ], metadata={"worker_id": s.worker_id, "kv_endpoint": self.transport.endpoint or ""})
        await nc.flush()  # registration must reach the server before anyone is told we are up
        self.outbox.start()
        await self.beats.beat()
        self.beats.start()

    async def stop_intake(self) -> None:
        self.draining = True
        await self.micro.stop()

    def in_flight(self) -> int:
        return len(self.requests)

    async def abort_in_flight(self) -> None:
        # Past the grace period (or drained by the planner): the gateway moves each request to another worker.
        for rid in self.requests.ids():
            await self._abort(rid, codes.MOVE_ELSEWHERE, error=True)

    async def release(self, remaining_s: float) -> None:
        await self.outbox.flush()
        await self.offload_before_leaving(remaining_s)
        self.outbox.stop()
        self.beats.stop()
        await self.cancel_sub.unsubscribe()
        await self.replay_served.stop()
        if self.suffix_sharing is not None:
            await self.suffix_sharing.stop()
        await self.transport.stop()
        self.thread.stop()

    # --- requests -----------------------------------------------------------------------------

    async def _on_generate(self, req: GenerateRequest, ctx: bus.RequestContext) -> None:
        self.num_received += 1
        if self.draining:
            raise bus.RemoteError(codes.OVERLOADED, "decode worker is shutting down")
        if req.request_id in self.requests:
            raise bus.RemoteError(codes.BAD_REQUEST, f"request id {req.request_id!r} is already running")
        if self.requests.was_cancelled(req.request_id):
            stream = ctx.stream()
            await stream.send(TokenChunk(request_id=req.request_id, seq=0, finish_reason="abort"))
            await stream.end()
            return
        if self.suffix_sharing is not None:
            self.suffix_sharing.saw_salt(req.sampling.cache_salt)
        span = _tracer.start_span("decode.request", attributes={
            "kvmesh.request_id": req.request_id, "kvmesh.worker_id": self.settings.worker_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        r = DecodeRequest(req, ctx.stream(), span)
        r.admission = Admission(req, self, self.admission_settings, span)
        self.requests.add(r)
        r.admission.start()
        self.beats.changed()

    # Admission's host interface.

    async def reject(self, admission: Admission, message: str, code: str = codes.BAD_REQUEST) -> None:
        r = self.requests.pop(admission.rid)
        if r is None:
            return
        r.span.set_status(trace.StatusCode.ERROR, message)
        await r.stream.end(error=ErrorReply(code=code, message=message))
        r.span.end()

    def admitted(self, admission: Admission) -> None:
        self.remote_prefills += admission.went_remote and not admission.fell_back and admission.state is State.RUNNING
        self.remote_fallbacks += admission.fell_back
        self.prefill_moves += admission.prefill_moves
        self.queued_local += admission.state is State.QUEUED

    # --- outputs --------------------------------------------------------------------------------

    def _on_step(self, outputs: list[RequestOutput], events, offload) -> None:
        if self.suffix_sharing is not None:
            self.suffix_sharing.publish([(r.req.sampling.cache_salt, out.output_token_ids) for out in outputs
                                         if out.finished and out.finish_reason in ("stop", "length")
                                         and (r := self.requests.get(out.request_id)) is not None])
        for out in outputs:
            self._emit(out)
        for event in events:
            self.outbox.put(Delivery(None, None, to_wire(event, self.settings.worker_id), False))
        super()._on_step(outputs, events, offload)

    def _emit(self, out: RequestOutput) -> None:
        r = self.requests.get(out.request_id)
        if r is None:
            return
        lps = None
        if r.req.sampling.logprobs is not None and out.logprobs:
            lps = [TokenLogprob.from_engine(lp) for lp in out.logprobs[-len(out.new_token_ids):]]
        plps = None
        if r.next_seq == 0 and out.prompt_logprobs is not None:
            plps = [None if lp is None else TokenLogprob.from_engine(lp) for lp in out.prompt_logprobs]
        cached = r.admission.num_cached_tokens if r.admission else 0
        chunk = TokenChunk(request_id=out.request_id, seq=r.next_seq, token_ids=out.new_token_ids, logprobs=lps,
                           prompt_logprobs=plps,
                           finish_reason=out.finish_reason if out.finished else None,
                           num_cached_tokens=max(cached, out.num_cached_tokens) if r.next_seq == 0 else None,
                           timings=request_timings(out) if out.finished else None)
        if r.next_seq == 0:
            r.span.add_event("first_token")
        r.next_seq += 1
        if out.finished:
            self.requests.pop(out.request_id)
            r.span.set_attribute("gen_ai.usage.output_tokens", len(out.output_token_ids))
            r.span.set_attribute("gen_ai.response.finish_reasons", [out.finish_reason])
        self.replay.keep(chunk)
        self.outbox.put(Delivery(r.stream, r.span, chunk, out.finished))

    async def on_engine_crash(self) -> None:
        self.draining = True
        # A lost tensor-parallel rank is this worker's hardware/process failing, not its requests: they go on
        # elsewhere with the drain's MOVE_ELSEWHERE chunk, which the gateway already answers by migrating
        # (prompt + tokens streamed so far, this worker excluded) at once, without waiting for our beats to
        # expire; the worker then exits non-zero (wait_closed) and its supervisor restarts it. Any other engine
        # error may be caused by a request (a bug it triggers would crash the next worker too): those fail.
        lost_rank = isinstance(self.thread.error, TPRankError)
        if lost_rank:
            log.error("decode worker lost a tensor-parallel rank; moving %d request(s) to other workers",
                      len(self.requests))
        for rid in self.requests.ids():
            r = self.requests.pop(rid)
            self.outbox.put(Delivery(r.stream, r.span, TokenChunk(
                request_id=rid, seq=r.next_seq, finish_reason="error",
                error=codes.MOVE_ELSEWHERE if lost_rank else "decode worker failed"), True))
        await asyncio.wait_for(self.outbox.flush(), timeout=5)

    # --- cancellation ---------------------------------------------------------------------------

    async def _on_cancel(self, msg: CancelRequest, ctx: bus.RequestContext) -> None:
        self.num_cancels += 1
        if msg.request_id in self.requests:
            # Not awaited here: cancels are handled one at a time, and each abort waits for the engine's step in
            # progress. A burst of them (clients leaving an overloaded mesh) would cost a step each, and on a busy
            # CPU the requests of clients long gone would run on for many seconds; spawned, the aborts reach the
            # engine together and end between two steps.
            task = asyncio.ensure_future(self._abort(msg.request_id, msg.reason or "cancelled"))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)
        else:
            self.requests.remember_cancel(msg.request_id)
        self.replay.forget(msg.request_id)  # the gateway gave it up (its abort chunk too): it asks for no replay

    async def _abort(self, rid: str, reason: str, error: bool = False) -> None:
        r = self.requests.pop(rid)
        if r is None:
            return
        if r.admission is not None:
            await r.admission.cancel(reason)
        self.beats.changed()
        r.span.add_event("cancelled", {"reason": reason})
        chunk = TokenChunk(request_id=rid, seq=r.next_seq, finish_reason="error" if error else "abort",
                           error=reason if error else None)
        self.replay.keep(chunk)
        self.outbox.put(Delivery(r.stream, r.span, chunk, True))

    # --- replay ---------------------------------------------------------------------------------

    async def _on_replay(self, msg: ReplayRequest, ctx: bus.RequestContext) -> None:
        """The gateway lost chunks from msg.from_seq on (its connection dropped and came back): the request's
        stream moves to this request's reply subject, kept chunks first, then the rest as it is generated.
        One subject per stream at a time, fed by the one outbox, keeps the order: chunks queued for the old
        subject before the switch still go there (nobody reads it any more) and are also in the replay."""
        r = self.requests.get(msg.request_id)
        chunks = self.replay.since(msg.request_id, msg.from_seq, r.next_seq if r is not None else None)
        self.beats.changed()  # the replay counters
        if chunks is None:
            raise bus.RemoteError(codes.NOT_FOUND,
                                  f"request {msg.request_id!r}: chunks from {msg.from_seq} are not kept")
        stream = ctx.stream()
        if r is not None:
            r.stream = stream  # what the engine emits from now on (r.span ends with the last chunk, as before)
        for chunk in chunks:  # (a tail that ended: its span has ended too)
            self.outbox.put(Delivery(stream, trace.INVALID_SPAN, chunk, chunk.finished))

    def load_subject(self) -> str:
        return subjects.decode_load(self.settings.worker_id)

    async def _load_snapshot(self) -> LoadBeat:
        beat = await super()._load_snapshot()
        return beat.model_copy(update={"stream_replays": self.replay.served,
                                       "stream_replay_misses": self.replay.missed})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--worker-id", default=os.environ.get("KVMESH_WORKER_ID") or default_worker_id("decode"))
    parser.add_argument("--remote-prefill-threshold", type=int,
                        default=int(os.environ.get("KVMESH_REMOTE_PREFILL_THRESHOLD", 512)),
                        help="uncached prompt tokens at which prefill goes to a prefill worker (0: always, "
                             "a huge number: never)")
    parser.add_argument("--no-kvstore", action="store_true", help="neither fetch from nor offload to the kvstore")
    parser.add_argument("--remote-prefill-timeout", type=float, default=2.0,
                        help="seconds a prefill worker has to answer, plus --remote-prefill-timeout-per-token for "
                             "each uncached prompt token; past it decode prefills locally")
    parser.add_argument("--remote-prefill-timeout-per-token", type=float, default=None, metavar="SECONDS",
                        help=f"default {GPU_PREFILL_S_PER_TOKEN:g} on a GPU, {CPU_PREFILL_S_PER_TOKEN:g} on CPUs, where a "
                             "prefill worker computes a long prompt at a few ms a token")
    parser.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    parser.add_argument("--kv-host", default=os.environ.get("KVMESH_KV_HOST"),
                        help="address prefill workers push KV to directly (shared memory on this host, TCP from "
                             "others); default: the address this worker reaches NATS from (env KVMESH_KV_HOST)")
    parser.add_argument("--no-direct-kv", action="store_true", help="prefill workers push KV over NATS only")
    parser.add_argument("--share-suffix-outputs", action="store_true",
                        default=os.environ.get("KVMESH_SHARE_SUFFIX_OUTPUTS", "") == "1",
                        help="suffix speculation: publish finished outputs to the other decode workers' suffix "
                             "tables and learn theirs (env KVMESH_SHARE_SUFFIX_OUTPUTS=1)")
    parser.add_argument("--no-rank-kv", action="store_true",
                        help="tensor parallel: a prefill worker of the same degree pushes whole blocks through rank 0 "
                             "(default: each rank's KV heads straight to the matching rank)")


def build(args: argparse.Namespace) -> DecodeService:
    factory = engine_factory_from_args(args)
    service = DecodeService(engine_config_from_args(args), DecodeSettings(
        worker_id=args.worker_id, remote_prefill_threshold=args.remote_prefill_threshold,
        use_kvstore=not args.no_kvstore, remote_prefill_timeout_s=args.remote_prefill_timeout,
        remote_prefill_timeout_per_token_s=args.remote_prefill_timeout_per_token,
        kv_transfer_timeout_s=args.kv_transfer_timeout, kv_host=args.kv_host, rank_kv=not args.no_rank_kv,
        share_suffix_outputs=args.share_suffix_outputs,
        # A simulated worker's placeholder KV travels over NATS: the direct channel's frames refuse it.
        direct_kv=not args.no_direct_kv and factory is None))
    service.engine_factory = factory
    return service
