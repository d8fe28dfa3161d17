"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}` for every failure.

FastAPI answers invalid bodies with 422 and its own shape; OpenAI clients expect 400 and this
shape, so the handlers here replace FastAPI's.
"""
from __future__ import annotations

import json
import random
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

RETRY_AFTER_S = 1

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error"}
# Every error carries a code: a specific one where the raiser gives it, else one from the status.
_DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                  413: "request_too_large", 429: "too_many_requests", 499: "client_closed", 500: "internal", 503: "overloaded",
                  504: "timeout"}


class APIError(Exception):
    """An error the client should see as is: an HTTP status and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _DEFAULT_CODES.get(status, "error")
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, code: str = "overloaded") -> APIError:
    """503 with Retry-After: nothing is wrong with the request, try again shortly. retry-after-ms spreads the
    clients refused together over [1, 2) s (a constant sends them back in lock-step)."""
    ms = round(1000 * RETRY_AFTER_S * (1.0 + random.random()))
    return APIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S), "retry-after-ms": str(ms)})


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Unions report each branch as a loc element ("str", "list[int]"); keep the field path only.
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    if loc == [] and first.get("type") == "missing":
        return bad_request("request body is required", code="invalid_json")
    if first.get("type") == "unsendable":  # services/gateway/wire_safe.py: the field path is in ctx
        ctx = first.get("ctx", {})
        # A union of request models puts the model's class name in loc: field names are lower case.
        parts = [p for p in [*loc, ctx.get("field", "")] if p and not _is_type_name(p) and not p[:1].isupper()]
        param = ".".join(parts) or None
        return bad_request(f"{param or 'body'}: {ctx.get('problem', 'invalid value')}", param=param, code="invalid_value")
    msg = first.get("msg", "invalid value")
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(f"{param or 'body'}: {msg}", param=param, code="invalid_value")


def _is_type_name(part: str) -> bool:
    return any(c in part for c in "[]()") or part in ("str", "int", "float", "bool", "list", "dict")


def _counted(request: Request, err: APIError) -> JSONResponse:
    """Errors raised before an endpoint runs (validation, auth, unknown routes) count in request_errors too."""
    ctx = getattr(request.app.state, "ctx", None)
    if ctx is not None:
        ctx.metrics.error(err.status)
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _counted(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _counted(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return _counted(request, APIError(exc.status_code, detail or phrase, headers=dict(exc.headers or {})))
