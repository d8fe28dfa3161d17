"""What every HTTP request passes before any of it is parsed: the API key, admission (a fast 429 past the
gateway's bound on requests at once: services/gateway/overload.py), then a bound on the body.

An ASGI middleware, so a wrong key is a 401 without reading the body, and a body larger than the limit
is a 413 as soon as its size is known (Content-Length) or its bytes pass the limit (chunked uploads),
never parsed and never forwarded. The body read here is handed to the app as one message; later
messages (the client's disconnect) still come from the connection.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.auth import check_api_key
from services.gateway.errors import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# Paths anyone may read: liveness, Prometheus, the version.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})  # /ping: /health under SageMaker's name
# Bytes of request body per token of context: room for JSON-escaped text, token-id lists and tool schemas.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_FLOOR = 1 << 20


def default_body_limit(max_model_len: int) -> int:
    return BODY_BYTES_FLOOR + BODY_BYTES_PER_TOKEN * max_model_len


class Intake:
    def __init__(self, app: Callable, api_key: str | None, max_body_bytes: Callable[[], int],
                 on_error: Callable[[int], None] = lambda status: None,
                 admit: Callable[[str], None] = lambda path: None) -> None:
        self.app = app
        self.admit = admit  # raises an APIError (429) when the gateway takes no more requests on this path
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes  # a callable: the limit follows max_model_len once workers report it
        self.on_error = on_error  # counts the error in the gateway's metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            if scope["path"] not in OPEN_PATHS:
                # Anthropic's clients send their key as x-api-key (/v1/messages); OpenAI's as a bearer token.
                key = _header(scope, b"x-api-key")
                check_api_key(self.api_key, _header(scope, b"authorization") or (f"Bearer {key}" if key else None))
            if scope["method"] in ("POST", "PUT", "PATCH"):
                self.admit(scope["path"])
                receive = await self._bounded(scope, receive)
        except APIError as e:
            self.on_error(e.status)
            return await e.response()(scope, receive, send)
        await self.app(scope, receive, send)

    async def _bounded(self, scope: Scope, receive: Receive) -> Receive:
        limit = self.max_body_bytes()
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return _replay([message], receive)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return _replay([{"type": "http.request", "body": b"".join(parts), "more_body": False}], receive)


def _replay(first: list[dict[str, Any]], receive: Receive) -> Receive:
    async def replay() -> dict[str, Any]:
        return first.pop(0) if first else await receive()
    return replay


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
