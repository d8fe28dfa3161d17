"""The NATS bus: typed request/reply, streaming, chunking, serving, discovery, trace context.

    nc = await bus.connect()                       # NATS_URL, NATS_CREDS, NATS_TLS_CA, ...
    reply = await bus.request(nc, subjects.TOKENIZER_ENCODE, EncodeRequest(prompt="hi"), expect=EncodeReply)
    served = await bus.serve(nc, subjects.TOKENIZER_ENCODE, subjects.QUEUE_TOKENIZER, handler, EncodeRequest)
"""
from shared.bus.chunks import Envelope, Reassembler
from shared.bus.client import publish, request, request_idempotent, request_stream, send_request
from shared.bus.connect import connect
from shared.bus.errors import (BusError, BusTimeout, ChunkError, MessagesDroppedError, NoRespondersError, RemoteError,
                               StreamGapError)
from shared.bus.limits import DEFAULT_LIMITS, BusLimits
from shared.bus.micro import Endpoint, MicroService, add_micro_service
from shared.bus.sender import set_sender
from shared.bus.server import Dispatcher, RequestContext, Served, serve, subscribe
from shared.bus.stream import ReplyStream, StreamReply, stream_reply

__all__ = [
    "BusError", "BusLimits", "BusTimeout", "ChunkError", "DEFAULT_LIMITS", "Dispatcher", "Endpoint",
    "Envelope", "MessagesDroppedError", "MicroService", "NoRespondersError", "Reassembler", "RemoteError", "ReplyStream",
    "RequestContext", "Served", "StreamGapError", "StreamReply", "add_micro_service", "connect",
    "publish", "request", "request_idempotent", "request_stream", "send_request", "serve", "set_sender", "stream_reply",
    "subscribe",
]  # fmt: skip
