"""What every HTTP request passes before any of it is parsed: the API key, admission (a fast 429 past the
gateway's bound on requests at once: services/gateway/overload.py), then a bound on the body.

An ASGI middleware, so a wrong key is a 401 without reading the body, and a body larger than the limit
is a 413 as soon as its size is known (Content-Length) or its bytes pass the limit (chunked uploads),
never parsed and never forwarded. The body read here is handed to the app as one message; later
messages (the client's disconnect) still come from the connection.

Two browser-borne attacks on a gateway bound to a local address are refused here too. A web page may post
to any address without a CORS preflight when the body is text/plain, a form or has no content type at all
(a "simple request"): a body is taken only as application/json (415 otherwise), which a page can send
cross-origin only after a preflight the gateway never grants. DNS rebinding points a page's own host name at
127.0.0.1, so its requests arrive with that name in Host: only trusted host names are served (400 otherwise).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.gateway.auth import SCOPE_KEY, check_api_key
from services.gateway.errors import APIError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# Paths anyone may read: liveness, Prometheus, the version.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})  # /ping: /health under SageMaker's name
# Bytes of request body per token of context: room for JSON-escaped text, token-id lists and tool schemas.
BODY_BYTES_PER_TOKEN = 64
BODY_BYTES_FLOOR = 1 << 20
# The names a gateway bound to a loopback address answers to by default (any port).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
LOOPBACK_BINDS = frozenset({"127.0.0.1", "localhost", "::1"})


def default_trusted_hosts(bind: str) -> tuple[str, ...] | None:
    """Loopback names for a gateway bound to loopback (no other name can reach it but through DNS rebinding);
    None (any Host) for one bound elsewhere, whose clients use names only its operator knows."""
    return LOOPBACK_HOSTS if bind in LOOPBACK_BINDS or bind.startswith("127.") else None


def host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def default_body_limit(max_model_len: int) -> int:
    return BODY_BYTES_FLOOR + BODY_BYTES_PER_TOKEN * max_model_len


class Intake:
    def __init__(self, app: Callable, api_key: str | None, max_body_bytes: Callable[[], int],
                 on_error: Callable[[int], None] = lambda status: None,
                 admit: Callable[[str], None] = lambda path: None,
                 trusted_hosts: tuple[str, ...] | None = None) -> None:
        """trusted_hosts: the host names (lowercase, no port) requests may name in Host; "*" or None: any."""
        self.app = app
        self.trusted_hosts = None if trusted_hosts is None or "*" in trusted_hosts else \
            frozenset(h.lower() for h in trusted_hosts)
        self.admit = admit  # raises an APIError (429) when the gateway takes no more requests on this path
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes  # a callable: the limit follows max_model_len once workers report it
        self.on_error = on_error  # counts the error in the gateway's metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            if self.trusted_hosts is not None:
                host = host_name(_header(scope, b"host") or "")
                if host not in self.trusted_hosts:
                    raise APIError(400, f"the Host header names {host!r}, which this gateway does not serve "
                                        "(--trusted-hosts)", code="untrusted_host")
            if scope["path"] not in OPEN_PATHS:
                # Anthropic's clients send their key as x-api-key (/v1/messages); OpenAI's as a bearer token.
                key = _header(scope, b"x-api-key")
                tenant = check_api_key(self.api_key, _header(scope, b"authorization") or (f"Bearer {key}" if key else None))
                if tenant is not None:  # the caller's own prefix cache (services/gateway/auth.py)
                    scope.setdefault("state", {})[SCOPE_KEY] = tenant
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
        if size and not _is_json(_header(scope, b"content-type")):
            raise APIError(415, "the request body must be sent with Content-Type: application/json",
                           code="unsupported_media_type")
        return _replay([{"type": "http.request", "body": b"".join(parts), "more_body": False}], receive)


def _replay(first: list[dict[str, Any]], receive: Receive) -> Receive:
    async def replay() -> dict[str, Any]:
        return first.pop(0) if first else await receive()
    return replay


def _is_json(content_type: str | None) -> bool:
    """application/json, or a +json type, with any parameters (charset)."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
