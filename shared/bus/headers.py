"""Header names the bus puts on NATS messages, and W3C trace context in and out of them."""
from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate

CHUNK = "Kvmesh-Chunk"  # "i/n": this is chunk i (0-based) of n
MSG_ID = "Kvmesh-Msg-Id"  # groups the chunks of one logical message
SIZE = "Kvmesh-Size"  # byte length of the whole logical message
UPLOAD = "Kvmesh-Upload"  # request: "1" on chunk 0; handshake answer: inbox for chunks 1..n-1
REPLY = "Kvmesh-Reply"  # an upload's real reply subject (its NATS reply carries the handshake)
SEQ = "Kvmesh-Seq"  # stream item number, 0-based
END = "Kvmesh-End"  # end of stream; value: number of items sent; body: empty or an ErrorReply
FROM = "Kvmesh-From"  # the sender's identity (shared/bus/sender.py), when it has one
TRACEPARENT = "traceparent"  # W3C trace context, put there by `with_trace` (absent: the sender was in no trace)
STATUS = "Status"  # set by the NATS server on status messages; "503" = no responders

FRAMING = (CHUNK, MSG_ID, SIZE, UPLOAD, REPLY)


def with_trace(headers: dict[str, str] | None = None, ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Headers plus traceparent/tracestate of `ctx` (default: the current context)."""
    out = dict(headers or {})
    propagate.inject(out, context=ctx)
    return out


def trace_context(headers: dict[str, str] | None) -> otel_context.Context:
    """The caller's context carried in `headers` (empty context when there is none)."""
    return propagate.extract(headers or {})


def header_bytes(headers: dict[str, str] | None) -> int:
    """Bytes the headers take on the wire; the server counts them against max_payload."""
    if not headers:
        return 0
    return len(b"NATS/1.0\r\n\r\n") + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
