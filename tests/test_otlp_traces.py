"""Traces as a user sees them in Jaeger: `kvmesh up` (real processes, real nats-server) exporting over
OTLP/HTTP to a real receiver (tests/otlp_receiver.py decodes the protobuf export). One streamed chat
request is one trace across every service, with the parent links and GenAI attributes right; a
cancelled request and a migrated one (its decode worker SIGKILLed mid-stream) lose nothing."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from shared import subjects
from shared.bus.natsd import free_port
from shared.launcher.up import READY
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.test_launcher import ROOT, Lines, _env

# A prompt long enough for several KV blocks: prefilled remotely (threshold 0), its blocks written
# through to the kvstore, where a migrated request's new worker finds them.
SYSTEM = "You are a careful assistant. The mesh moves KV blocks between workers and keeps them in a store. " * 4


class UpMesh:
    def __init__(self, proc: subprocess.Popen, out: Lines, base: str, receiver: OtlpReceiver) -> None:
        self.proc, self.out, self.base, self.receiver = proc, out, base, receiver
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def pids(self) -> dict[str, int]:
        return {m[1]: int(m[2]) for line in self.out.lines if (m := re.search(r"^\[kvmesh\] started (\S+) \(pid (\d+)\)", line))}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from shared.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("otlp") / "demo")


@pytest.fixture(scope="module")
def mesh(demo_model: Path, tmp_path_factory) -> Iterator[UpMesh]:
    tmp = tmp_path_factory.mktemp("otlp-up")
    with OtlpReceiver() as receiver:
        env = _env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
                   OTEL_BSP_SCHEDULE_DELAY="100",  # export within 0.1 s (the test finds the serving worker by its spans)
                   KVMESH_OFFLOAD_POLICY="write-through")  # every new block goes to the kvstore at once
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", "--model", str(demo_model), "--port", str(free_port()),
             "--grace", "5", "--startup-timeout", "150", "--remote-prefill-threshold", "0", "--decode", "2",
             "--prefill", "1", "--kvstore-disk-dir", str(tmp / "kvstore")],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out = Lines(proc.stdout)
            base = out.wait_for(rf"{READY} (http://\S+)/v1", timeout=180)[1]
            m = UpMesh(proc, out, base, receiver)
            # Both decode workers and the prefill worker beat before any test routes (/health waits only for a
            # decode worker; the migration test needs a second one, every test the prefill worker).
            deadline = time.monotonic() + 60
            while True:
                load = httpx.get(f"{base}/get_load", timeout=5).json()
                if load["num_decode_workers"] == 2 and load["num_prefill_workers"] == 1:
                    break
                assert time.monotonic() < deadline, f"the workers never all showed up: {load}"
                time.sleep(0.2)
            yield m
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me about the mesh ({tag})."}]


def _gen_span(spans: list[ReceivedSpan], request_id: str) -> ReceivedSpan | None:
    return next((s for s in spans if s.service == "kvmesh-gateway" and s.attributes.get("kvmesh.request_id") == request_id),
                None)


def _wait_trace(mesh: UpMesh, request_id: str, names: set[str], orphans_of: int | None = None
                ) -> tuple[ReceivedSpan, ReceivedSpan, list[ReceivedSpan]]:
    """(the HTTP server span at the trace's root, the gateway's GenAI span of the request, the whole trace),
    once the trace holds spans of every name in `names` and every span's parent has come (spans of the
    process `orphans_of` excepted: a SIGKILLed worker never exports the spans it had open)."""
    def found(spans: list[ReceivedSpan]):  # noqa: ANN202
        gen = _gen_span(spans, request_id)
        if gen is None:
            return None
        trace = [s for s in spans if s.trace_id == gen.trace_id]
        ids = {s.span_id for s in trace}
        roots = [s for s in trace if s.parent_id is None]
        waiting = [s for s in trace if s.parent_id is not None and s.parent_id not in ids and s.pid != orphans_of]
        return (roots[0], gen, trace) if len(roots) == 1 and not waiting and names <= {s.name for s in trace} else None
    return mesh.receiver.wait_for(found, timeout=20, what=f"trace of {request_id} with {sorted(names)}")


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[ReceivedSpan]:
    out = []
    while span.parent_id is not None and span.parent_id in by_id:
        span = by_id[span.parent_id]
        out.append(span)
    return out


def _one(trace: list[ReceivedSpan], name: str, **where) -> ReceivedSpan:  # noqa: ANN003
    got = [s for s in trace if s.name == name and all(getattr(s, k) == v for k, v in where.items())]
    assert len(got) == 1, f"{len(got)} spans named {name!r} {where}: {[(s.service, s.name) for s in trace]}"
    return got[0]


def _request_id(chunk_id: str) -> str:
    return chunk_id.removeprefix("chatcmpl-")


def _stream(mesh: UpMesh, tag: str, max_tokens: int, **extra):  # noqa: ANN003, ANN202
    return mesh.client.chat.completions.create(
        model=mesh.model, messages=_messages(tag), max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra})


def test_one_streamed_chat_is_one_trace_across_every_service(mesh: UpMesh) -> None:
    chunks = list(_stream(mesh, "first", 8))
    rid = _request_id(chunks[0].id)
    assert chunks[-1].usage.completion_tokens == 8
    root, gen, trace = _wait_trace(mesh, rid, {"stream", "route", "decode.request", "decode.admit", "decode.remote_prefill",
                                               "prefill.compute", "kv.transfer.send", "kv.transfer.receive",
                                               f"serve {subjects.TOKENIZER_ENCODE}"})
    by_id = {s.span_id: s for s in trace}
    # One tree: every span's parent is in the trace, and it leads up to the HTTP server span.
    for s in trace:
        assert s is root or s.parent_id in by_id, f"{s.service} {s.name}: parent {s.parent_id} not in the trace"
        assert s is root or root in _ancestors(s, by_id), f"{s.service} {s.name} is not under the request's span"
    assert {"kvmesh-gateway", "kvmesh-tokenizer", "kvmesh-decode", "kvmesh-prefill", "kvmesh-kvstore"} <= {s.service for s in trace}
    assert root.name == "POST /v1/chat/completions" and root.is_server and root.service == "kvmesh-gateway"
    # The inference span, named and attributed as the OpenTelemetry GenAI conventions say.
    assert gen.name == f"chat {mesh.model}" and root in _ancestors(gen, by_id) and not gen.is_error
    a = gen.attributes
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"], a["gen_ai.response.model"]) == ("chat", mesh.model, mesh.model)
    assert a["gen_ai.request.max_tokens"] == 8 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] == chunks[-1].usage.prompt_tokens
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.response.id"] == rid
    assert a["http.route"] == "/v1/chat/completions" and "first_token" in gen.event_names()
    # Direct children of the inference span: tokenize (the bus request), route, the decode request, the stream.
    children = {s.name for s in trace if s.parent_id == gen.span_id}
    assert {f"request {subjects.TOKENIZER_ENCODE}", "route", "stream"} <= children
    route = _one(trace, "route")
    worker = route.attributes["kvmesh.decode.worker"]
    assert f"request {subjects.decode_generate(worker)}" in children
    assert _one(trace, f"serve {subjects.TOKENIZER_ENCODE}").service == "kvmesh-tokenizer"
    # decode.request (on the routed worker) -> decode.remote_prefill -> the prefill worker's compute and push.
    decode = _one(trace, "decode.request")
    assert decode.service == "kvmesh-decode" and decode.attributes["kvmesh.worker_id"] == worker
    assert _one(trace, "decode.admit").parent_id == decode.span_id
    remote = _one(trace, "decode.remote_prefill")
    assert remote.parent_id == decode.span_id
    compute = _one(trace, "prefill.compute")
    assert compute.service == "kvmesh-prefill" and remote in _ancestors(compute, by_id)
    sends = [s for s in trace if s.name == "kv.transfer.send"]
    assert sends and all(s.service == "kvmesh-prefill" and remote in _ancestors(s, by_id) for s in sends)
    receives = [s for s in trace if s.name == "kv.transfer.receive"]
    assert receives and all(s.service == "kvmesh-decode" and decode in _ancestors(s, by_id) for s in receives)
    # The streamed chunks: an event each, the last one with the finish reason.
    stream = _one(trace, "stream")
    events = [e for name, e in stream.events if name == "chunk"]
    assert stream.attributes["kvmesh.stream.chunks"] == len(events) >= 2
    assert sum(e["kvmesh.chunk.tokens"] for e in events) == 8
    assert events[-1]["gen_ai.response.finish_reasons"] == ("length",)
    # The kvstore tier was asked for the prompt's blocks (the first request finds none), inside the trace.
    lookups = [s for s in trace if s.service == "kvmesh-kvstore" and s.name == f"serve {subjects.KVSTORE_GET}"]
    assert lookups and all(any(a.name == "kvstore.get" for a in _ancestors(s, by_id)) for s in lookups)
    assert all(s.start_ns >= root.start_ns - 50_000_000 for s in trace)  # clocks of one machine


def test_a_cancelled_request_ends_its_spans_everywhere(mesh: UpMesh) -> None:
    stream = _stream(mesh, "cancelled", 1500)
    it = iter(stream)
    first = next(it)
    next(it)
    stream.close()  # the client goes away mid-stream
    rid = _request_id(first.id)
    root, gen, trace = _wait_trace(mesh, rid, {"stream", "decode.request"})
    assert gen.is_error and gen.attributes["error.type"] == "cancelled" and "cancelled" in gen.event_names()
    assert _one(trace, "stream").attributes["error.type"] == "cancelled"
    decode = _one(trace, "decode.request")
    assert "cancelled" in decode.event_names(), decode.events  # the worker heard the cancel and ended its span
    assert decode.attributes.get("gen_ai.usage.output_tokens") is None  # it did not run on to max_tokens
    by_id = {s.span_id: s for s in trace}
    assert all(s is root or root in _ancestors(s, by_id) for s in trace)


def test_a_migrated_request_keeps_one_trace(mesh: UpMesh) -> None:
    before = {s.span_id for s in mesh.receiver.snapshot()}
    stream = _stream(mesh, "migrated", 1500)
    it = iter(stream)
    first = next(it)
    rid = _request_id(first.id)
    # The worker serving it, from its exported admission span (process.pid is in every span's resource).
    admit = mesh.receiver.wait_for(
        lambda spans: next((s for s in spans if s.name == "decode.admit" and s.span_id not in before), None),
        timeout=10, what="decode.admit of the request")
    # Each process's spans reach the receiver in the order it ended them (one batch processor, one exporter), so
    # once the worker's decode.remote_prefill is in, so is every span it ended before: it is the last to end
    # before the first token (after the prefill request's client span, its own child). Killed as soon as
    # decode.admit came, the worker died with whatever its batch processor had not sent yet: under load the
    # client span could have gone out and its parent not, a second missing parent besides decode.request.
    mesh.receiver.wait_for(
        lambda spans: any(s.name == "decode.remote_prefill" and s.trace_id == admit.trace_id for s in spans),
        timeout=10, what="decode.remote_prefill of the request")
    os.kill(admit.pid, signal.SIGKILL)
    text = first.choices[0].delta.content or ""
    last = None
    for c in it:
        last = c
        if c.choices:
            text += c.choices[0].delta.content or ""
    assert last is not None and last.usage.completion_tokens == 1500
    root, gen, trace = _wait_trace(mesh, rid, {"stream", "decode.request", "kvstore.get"}, orphans_of=admit.pid)
    assert (gen.attributes["gen_ai.usage.output_tokens"], gen.attributes["gen_ai.response.finish_reasons"]) == (1500, ("length",))
    (migrated,) = [e for name, e in gen.events if name == "migrated"]
    assert migrated["kvmesh.to"] != migrated["kvmesh.from"]
    assert not gen.is_error
    # Both workers' spans are in the trace: the dead one's (what it exported before it died) and the new one's.
    decode_pids = {s.pid for s in trace if s.service == "kvmesh-decode"}
    assert admit.pid in decode_pids and len(decode_pids) == 2
    new = _one(trace, "decode.request")  # the dead worker's never ended: it died with it
    assert new.pid != admit.pid and new.attributes["kvmesh.worker_id"] == migrated["kvmesh.to"]
    assert new.attributes["gen_ai.usage.output_tokens"] + migrated["kvmesh.tokens_done"] == 1500
    # The new worker found the prompt's blocks in the kvstore (written through by the dead one or the prefill worker).
    store = [s for s in trace if s.name == "kvstore.get" and s.pid == new.pid]
    assert store and store[0].attributes.get("kvmesh.blocks_loaded", 0) > 0
    # Parent links: the only parent missing is the dead worker's unfinished decode.request.
    by_id = {s.span_id: s for s in trace}
    orphans = [s for s in trace if s is not root and s.parent_id not in by_id]
    assert orphans and {s.pid for s in orphans} == {admit.pid}, [(s.service, s.name, s.pid) for s in orphans]
    assert len({s.parent_id for s in orphans}) == 1, [(s.name, s.parent_id) for s in orphans]
    for s in trace:  # every span leads up to the HTTP span, or to the dead worker's lost one
        top = (_ancestors(s, by_id) or [s])[-1]
        assert top is root or top in orphans, f"{s.service} {s.name} hangs off neither"
    stream_span = _one(trace, "stream")
    assert sum(e["kvmesh.chunk.tokens"] for name, e in stream_span.events if name == "chunk") <= 1500
    assert stream_span.attributes["kvmesh.stream.chunks"] >= 2
