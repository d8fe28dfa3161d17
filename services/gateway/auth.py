"""Bearer-token check for /v1/* when KVMESH_API_KEY is set (constant-time compare)."""
from __future__ import annotations

import hmac

from services.gateway.errors import APIError


def check_api_key(expected: str | None, authorization: str | None) -> None:
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # Compare bytes of both, always, so timing says nothing about where a wrong key differs.
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    if not hmac.compare_digest(given, expected.encode()):
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
