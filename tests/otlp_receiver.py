"""A real OTLP/HTTP trace receiver for tests: what Jaeger or a collector does with the services' exports.

It listens on POST /v1/traces, decodes each ExportTraceServiceRequest with opentelemetry-proto (the
protobuf encoding the services' OTLPSpanExporter sends, gzip or not) and keeps every span with the
service that sent it, so a test can read a trace the way a user sees it in Jaeger.
"""
from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                     ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan, Status as PbStatus


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    pid: int | None
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: int  # PbSpan.SpanKind
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    status_code: int  # PbStatus.StatusCode
    status_message: str
    start_ns: int
    end_ns: int

    @property
    def is_error(self) -> bool:
        return self.status_code == PbStatus.STATUS_CODE_ERROR

    @property
    def is_server(self) -> bool:
        return self.kind == PbSpan.SPAN_KIND_SERVER

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if which is None else getattr(v, which)


def _attrs(kvs) -> dict[str, Any]:  # noqa: ANN001 - repeated KeyValue
    return {kv.key: _value(kv.value) for kv in kvs}


def _event_attrs(e, event_times: bool) -> dict[str, Any]:  # noqa: ANN001 - a Span.Event
    return {**_attrs(e.attributes), "t_ns": e.time_unix_nano} if event_times else _attrs(e.attributes)


def decode_export(body: bytes, event_times: bool = False) -> list[ReceivedSpan]:
    """The spans of one OTLP export; with event_times each event's time (ns) is in its attributes as "t_ns"."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        res = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    service=str(res.get("service.name", "")), pid=res.get("process.pid"),
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex() or None,
                    name=s.name, kind=s.kind, attributes=_attrs(s.attributes),
                    events=tuple((e.name, _event_attrs(e, event_times)) for e in s.events),
                    status_code=s.status.code, status_message=s.status.message,
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))
    return out


@dataclass
class OtlpReceiver:
    """ThreadingHTTPServer on 127.0.0.1; `url` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    event_times: bool = False  # decode_export's: each event's time as its "t_ns" attribute

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                spans = decode_export(body, receiver.event_times)
                with receiver._cond:
                    receiver.spans.extend(spans)
                    receiver.exports += 1
                    receiver._cond.notify_all()
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.snapshot() if s.trace_id == trace_id]

    def wait_for(self, found: Callable[[list[ReceivedSpan]], Any], timeout: float, what: str) -> Any:
        """Until found(all spans so far) is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = found(list(self.spans))
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"no {what} in {timeout}s; spans received: {names}")
                self._cond.wait(min(left, 0.5))
