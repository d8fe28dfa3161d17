"""One choice's token stream from the decode workers, kept alive across failures: the GenerateRequest and its
reply stream of TokenChunks, watched for the worker's loss, resent from the first chunk lost when the gateway's
own connection dropped (a replay), and moved to another worker (a migration) with the tokens so far when the
worker is lost or draining. What the chunks become as text is services/gateway/choice.py's."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, unavailable
from services.gateway.router import NoWorkerError, OverloadedError
from shared import bus, subjects
from shared.protocol import errors as codes
from shared.protocol.generate import CancelRequest, GenerateRequest, ReplayRequest, TokenChunk
from shared.sampling_params import SamplingParams


STRUCTURED_ERRORS = tuple(f"invalid {kind}" for kind in ("json_object", "json_schema", "regex", "choice", "grammar"))


# How often a waiting stream checks that its worker still beats (detection is bounded by the router's expiry).
WATCH_INTERVAL_S = 0.25
# After the gateway's NATS connection came back, how long a stream may stay silent before it resumes elsewhere (its
# last chunks may have been lost while the inbox had no subscription); a chunk in sequence proves nothing was.
RECONNECT_GRACE_S = 2.0
# An interrupted stream first asks its worker to resend what was lost (services/decode/replay.py), at most this
# many times per choice (each follows a reconnect); past it, or when the worker no longer has the chunks, it migrates.
REPLAYS_PER_CHOICE = 8


class WorkerLost(Exception):
    """The decode worker serving a choice stopped beating."""


class StreamInterrupted(Exception):
    """The gateway's own NATS connection dropped and came back (its server died; it moved to another
    server of the cluster) while the stream was open: chunks sent meanwhile had no subscriber and are
    gone, including perhaps the last one. The worker is fine: the choice asks it to resend them (a replay)
    and resumes as a migration only if it cannot."""


class Idle:
    """Marks a point where a stream pauses: the next chunk needs a wait (TokenStream.chunks(idle_marks=True))."""


IDLE = Idle()


def remote_error(e: bus.RemoteError) -> APIError:
    if e.code == codes.BAD_REQUEST:
        # The engine judges structured-output constraints (it compiles them): name the field.
        param = "response_format" if e.message.startswith(STRUCTURED_ERRORS) else None
        return APIError(400, e.message, param=param, code="invalid_request")
    if e.code == codes.OVERLOADED:
        return unavailable(f"decode: {e.message}")
    return APIError(500, f"decode failed: {e.message}", code=e.code)


class TokenStream:
    """The TokenChunks of one choice in order, from whichever worker serves it. sent: a GenerateRequest is out
    and not finished, so a cancel may be needed (cancel_soon). generated: every token the choice kept so far,
    across migrations (a migration's continuation is the prompt plus these); its reader appends them (keep)."""

    def __init__(self, ctx: GatewayContext, request_id: str, prompt: list[int], sampling: SamplingParams,
                 priority: int, worker_id: str | None, span: trace.Span) -> None:
        self.ctx, self.span = ctx, span
        self.request_id = request_id
        self.worker_id = worker_id
        self._req = GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling, priority=priority)
        self.origin = self._req  # the request as the client asked it (a migration sends a continuation)
        self.generated: list[int] = []  # every token kept so far, across migrations
        self.migrations = 0
        self.replays = 0  # replays asked of the worker (served or not)
        self._next_seq = 0  # the seq of the next TokenChunk of the current request (what a replay starts from)
        self._dead: set[str] = set()  # workers this choice lost
        self._stream: bus.ReplyStream[TokenChunk] | None = None
        self._first: TokenChunk | None = None
        self.sent = False  # a GenerateRequest went out: a cancel may be needed
        self._reconnects = 0  # the connection's reconnect count the current stream is known to have survived
        self._reconnected_at: float | None = None  # when a reconnect the stream has not yet survived was seen
        self._worker_reconnects: int | None = None  # the routed worker's, from its beats (router.bus_reconnects)
        self._flight: tuple[str, str] | None = None  # (worker, request id) the router counts this stream on
        self._incarnation: str | None = None  # the routed worker's process, from its beats (router.incarnation)

    async def open(self) -> None:
        """Sends the request and waits for the first chunk, so refusals become HTTP statuses."""
        subject = subjects.decode_generate(self.worker_id) if self.worker_id else self.ctx.subjects.decode_generate_any
        try:
            self._first = await self._send(subject)
        except WorkerLost:  # it died before the first token (e.g. while prefilling): start over elsewhere
            self._first = await self._migrate()
        except StreamInterrupted:
            self._first = await self._resume()
        except bus.NoRespondersError:
            if self.worker_id is None:
                raise unavailable("no decode worker is available", code="no_decode_worker") from None
            # The routed worker is gone (its beats have not expired yet): any other worker will do.
            self.ctx.router.forget(self.worker_id)
            self.worker_id = None
            try:
                self._first = await self._send(self.ctx.subjects.decode_generate_any)
            except bus.NoRespondersError:
                raise unavailable("no decode worker is available", code="no_decode_worker") from None

    async def _request(self, subject: str, msg: GenerateRequest | ReplayRequest, sender: str | None
                       ) -> bus.ReplyStream[TokenChunk]:
        """Sends msg and reads the TokenChunks of its reply stream from now on, watched (_check_worker). sender:
        only that worker's chunks count (shared/bus/sender.py); None: whoever answers."""
        self._reconnects, self._reconnected_at = self.ctx.nc.stats["reconnects"], None
        self._worker_reconnects = self.ctx.router.bus_reconnects(self.worker_id) if self.worker_id else None
        self._incarnation = self.ctx.router.incarnation(self.worker_id) if self.worker_id else None
        with trace.use_span(self.span, end_on_exit=False):  # the trace context rides in the NATS headers
            stream = await bus.request_stream(self.ctx.nc, subject, msg, timeout=self.ctx.config.stream_idle_timeout_s,
                                              expect=TokenChunk, sender=sender, limits=self.ctx.stream_limits)
        self._stream = stream
        stream.watch(self._check_worker, WATCH_INTERVAL_S)
        return stream

    async def _send(self, subject: str) -> TokenChunk:
        # Routed to one worker: only its chunks count.
        sender = None if subject == self.ctx.subjects.decode_generate_any else subjects.worker_from_subject(subject)
        self._fly(sender)
        # Marked before it goes out: a request given up while being sent (its client left, its wait ran out) may
        # reach a worker all the same, and only a cancel stops it there (one overtaking it is remembered).
        self.sent = True
        try:
            stream = await self._request(subject, self._req, sender)
        except bus.NoRespondersError:
            self.sent = False
            self._land()
            raise
        try:
            return self._arrived(await stream.__anext__())
        except StopAsyncIteration:
            raise APIError(500, "decode ended the stream without a token") from None
        except bus.NoRespondersError:
            self.sent = False
            raise
        except bus.RemoteError as e:
            self.sent = False  # refused: nothing runs there
            raise remote_error(e) from None
        except bus.BusTimeout:
            raise APIError(504, "no answer from the decode worker in time", code="timeout") from None
        except bus.StreamGapError:  # the first chunks went missing (the connection moved between servers)
            raise StreamInterrupted() from None
        except bus.MessagesDroppedError:
            raise _fell_behind() from None

    async def chunks(self, idle_marks: bool = False) -> AsyncIterator[TokenChunk | Idle]:
        """The stream's chunks in order until its reader stops (it closes this generator once the choice is
        finished). idle_marks: also IDLE each time the next read would wait (nothing of this stream has arrived
        yet) or a migration starts, so a streaming caller sends what it holds then."""
        assert self._stream is not None and self._first is not None, "open() first"
        chunk: TokenChunk | None = self._first
        try:
            while chunk is not None:
                if chunk.finish_reason == "error" and chunk.error == codes.MOVE_ELSEWHERE:
                    # The worker is draining (the planner removes it, or it stops): continue elsewhere.
                    self.sent = False
                    if idle_marks:
                        yield IDLE
                    chunk = await self._migrate()
                    continue
                if chunk.finished:
                    self.sent = False  # the worker is done with it (or failed it): nothing to cancel
                yield chunk
                if idle_marks and not self._stream.ready:
                    yield IDLE
                try:
                    chunk = await self._next()
                except WorkerLost:
                    if idle_marks:
                        yield IDLE
                    chunk = await self._migrate()
                except StreamInterrupted:
                    if idle_marks:
                        yield IDLE
                    chunk = await self._resume()
            raise APIError(500, "decode ended the stream before the last token", code="stream_ended")
        finally:
            self._land()
            await self._stream.aclose()

    def keep(self, token_ids: list[int]) -> None:
        """Tokens of the choice's output (what a migration continues after)."""
        self.generated.extend(token_ids)

    def _check_worker(self) -> None:
        """Called by the stream while it waits for a chunk (every WATCH_INTERVAL_S, in the waiting task: no watcher
        task per chunk): WorkerLost as soon as the router stops hearing from the worker."""
        if self.worker_id is not None and not self.ctx.router.is_alive(self.worker_id):
            raise WorkerLost(self.worker_id)
        if self._restarted():
            raise WorkerLost(self.worker_id)
        if self._worker_moved():
            raise StreamInterrupted()
        if self.ctx.nc.stats["reconnects"] != self._reconnects:
            # The gateway's connection dropped and came back; the client library subscribed the inbox again. What
            # the worker sent meanwhile is gone, and the next chunk shows it (a gap in the sequence numbers:
            # StreamInterrupted, and the worker resends from the first chunk lost). Nothing lost: the stream goes
            # on as it was. Lost and nothing more coming (the last chunk went): silence, so past RECONNECT_GRACE_S
            # without a chunk the stream resumes all the same.
            now = time.monotonic()
            if self._reconnected_at is None:
                self._reconnected_at = now
            elif now - self._reconnected_at > RECONNECT_GRACE_S:
                raise StreamInterrupted()
        # (A stream whose messages NATS' client dropped because the gateway fell behind raises
        # MessagesDroppedError itself, checked at every wait.)

    def _restarted(self) -> bool:
        """The routed worker beats as another process than the one the request went to (killed and restarted under
        its id, faster than its beats expire): the request died with the old one."""
        if self.worker_id is None or not self._incarnation:
            return False
        now = self.ctx.router.incarnation(self.worker_id)
        return bool(now) and now != self._incarnation

    def _worker_moved(self) -> bool:
        """The routed worker's connection reconnected since the stream opened: on a locked-down bus its
        reply permission stayed with the old connection (shared/bus/roles.py), so nothing more can come."""
        if self.worker_id is None or self._worker_reconnects is None:
            return False
        now = self.ctx.router.bus_reconnects(self.worker_id)
        return now is not None and now > self._worker_reconnects

    async def _next(self) -> TokenChunk | None:
        assert self._stream is not None
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            return None
        except bus.RemoteError as e:
            raise remote_error(e) from None
        except bus.BusTimeout:
            raise APIError(504, f"decode sent nothing for {self.ctx.config.stream_idle_timeout_s:g}s", code="timeout") from None
        except bus.StreamGapError:  # chunks went missing (a connection moved between servers): resume
            raise StreamInterrupted() from None
        except bus.MessagesDroppedError:
            raise _fell_behind() from None
        except bus.BusError as e:
            raise APIError(500, f"lost the token stream: {e}", code="stream_error") from None
        return self._arrived(chunk)

    def _arrived(self, chunk: TokenChunk) -> TokenChunk:
        self._next_seq = chunk.seq + 1
        if self._flight is not None:
            self.ctx.router.arrived(*self._flight, len(chunk.token_ids))
            if chunk.finished:
                self._land()
        if self._reconnected_at is not None:  # in sequence after the reconnect: nothing was lost, go on
            self._reconnects, self._reconnected_at = self.ctx.nc.stats["reconnects"], None
        return chunk

    async def _resume(self) -> TokenChunk:
        """The stream broke, not the worker (StreamInterrupted): the worker resends from the first chunk lost
        and the stream goes on in order (no re-prefill; a sampled stream keeps its continuation). If it no
        longer has them (evicted, restarted, unknown request), the choice migrates."""
        while self.worker_id is not None and self.replays < REPLAYS_PER_CHOICE:
            self.replays += 1
            try:
                chunk = await self._replay(self.worker_id)
            except StreamInterrupted:  # the connection dropped again meanwhile: ask again
                continue
            except WorkerLost:
                return await self._migrate()
            if chunk is not None:
                return chunk
            break
        return await self._migrate(worker_died=False)

    async def _replay(self, worker_id: str) -> TokenChunk | None:
        """Asks the worker for this request's chunks from self._next_seq on; it moves the request's stream to this
        request's reply subject (services/decode/service.py: _on_replay). None: it cannot (then: migrate)."""
        if self._stream is not None:
            await self._stream.aclose()
        from_seq = self._next_seq
        req = ReplayRequest(request_id=self.request_id, from_seq=from_seq)
        try:
            stream = await self._request(subjects.decode_replay(worker_id), req, worker_id)
        except bus.BusError:
            return None
        try:
            chunk = await stream.__anext__()
        except StopAsyncIteration:
            return None
        except bus.StreamGapError:
            raise StreamInterrupted() from None
        except bus.MessagesDroppedError:
            raise _fell_behind() from None
        except bus.BusError:  # NOT_FOUND (not kept), no responders (restarted, gone), timeout
            self.span.add_event("replay_missed", {"kvmesh.worker_id": worker_id, "kvmesh.from_seq": from_seq})
            return None
        if chunk.seq != from_seq:
            return None
        self.span.add_event("replayed", {"kvmesh.worker_id": worker_id, "kvmesh.from_seq": from_seq})
        return self._arrived(chunk)

    async def _migrate(self, worker_died: bool = True) -> TokenChunk:
        """Continue on another decode worker: the prompt plus every token streamed so far, what is left of
        max_tokens. Greedy output is identical to an undisturbed run; the client sees no break.
        worker_died=False: the stream broke, not the worker (it may take the continuation itself)."""
        lost = self.worker_id
        self._land()
        if lost is not None and worker_died:
            self._dead.add(lost)
            self.ctx.router.forget(lost)
        self.cancel_soon("worker lost" if worker_died else "stream interrupted")  # if it is only slow, it must not run on
        if self._stream is not None:
            await self._stream.aclose()
        while True:
            if self.migrations >= self.ctx.config.migration_limit:
                raise unavailable(f"decode worker {lost} stopped answering and the request may not move again "
                                  f"(--migration-limit {self.ctx.config.migration_limit})", code="worker_lost")
            self.migrations += 1
            self.ctx.metrics.migrations.labels(self.ctx.metrics.model).inc()
            o, n = self.origin, len(self.generated)
            end = o.sampling.reasoning_end_ids
            sampling = o.sampling.model_copy(update={
                "max_tokens": o.sampling.max_tokens - n, "min_tokens": max(0, o.sampling.min_tokens - n),
                "prompt_logprobs": None,
                # Reasoning that ended before the move is in the continuation's prompt: no marker to wait for.
                "reasoning_end_ids": None if end and _contains(self.generated, end) else end})
            self.request_id = f"{o.request_id}-m{self.migrations}"
            self._req = GenerateRequest(request_id=self.request_id, prompt_token_ids=o.prompt_token_ids + self.generated,
                                        sampling=sampling, priority=o.priority)
            try:
                route = self.ctx.router.pick(self._req.prompt_token_ids, exclude=frozenset(self._dead),
                                             cache_salt=o.sampling.cache_salt,
                                             lora=self.ctx.loras.route_key(o.sampling.lora_name))
            except (NoWorkerError, OverloadedError):
                raise unavailable(f"decode worker {lost} stopped answering and no other worker can take the request",
                                  code="worker_lost") from None
            self.worker_id = route.worker_id
            self.span.add_event("migrated", {"kvmesh.from": lost or "", "kvmesh.to": route.worker_id,
                                             "kvmesh.tokens_done": n})
            try:
                return await self._send(subjects.decode_generate(route.worker_id))
            except StreamInterrupted:  # the connection dropped again: try once more, the worker is fine
                self.cancel_soon("stream interrupted")
                if self._stream is not None:
                    await self._stream.aclose()
                continue
            except (bus.NoRespondersError, WorkerLost):
                self._dead.add(route.worker_id)
                self.ctx.router.forget(route.worker_id)
                self.cancel_soon("worker lost")
                lost = route.worker_id

    async def close(self) -> None:
        self._land()
        if self._stream is not None:
            await self._stream.aclose()

    def _fly(self, worker_id: str | None) -> None:
        """The router counts this stream on the worker it goes to (None: whoever answers, not counted)."""
        self._land()
        if worker_id is not None:
            self._flight = (worker_id, self.request_id)
            self.ctx.router.dispatched(worker_id, self.request_id, len(self._req.prompt_token_ids))

    def _land(self) -> None:
        if self._flight is not None:
            self.ctx.router.landed(*self._flight)
            self._flight = None

    def cancel_soon(self, reason: str) -> None:
        """Tells every worker to drop this choice, at most once, from a task that outlives the request."""
        if self.sent:
            self.sent = False
            # The id now: a migration gives the choice a new one before this task runs.
            self.ctx.spawn(self._publish_cancel(self.request_id, reason))

    async def _publish_cancel(self, request_id: str, reason: str) -> None:
        # Unknown ids are ignored by the workers, so a cancel racing the last token is harmless.
        with trace.use_span(self.span, end_on_exit=False):
            await bus.publish(self.ctx.nc, subjects.DECODE_CANCEL, CancelRequest(request_id=request_id, reason=reason))


def _fell_behind() -> APIError:
    """The gateway itself could not keep up (a slow consumer): not moved elsewhere, which would only add load;
    the request ends with this error and its worker is told to cancel (the stream's error path aborts it)."""
    return unavailable("the gateway fell behind this token stream and lost part of it (overloaded); retry",
                       code="stream_lost")


def _contains(tokens: list[int], part: list[int]) -> bool:
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))
