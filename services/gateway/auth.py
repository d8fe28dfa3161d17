"""Bearer-token check for /v1/* when KVMESH_API_KEY is set (constant-time compare), and each key's own prefix cache.

KVMESH_API_KEY holds one key or several, comma separated (one per tenant). With keys, every request's blocks are
hashed under a cache salt derived from the caller's key (tenant_salt): a prefix another key's requests cached is
never a hit for this one, so `cached_tokens` and time to first token say nothing about other tenants' prompts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import TYPE_CHECKING

from services.gateway.errors import APIError

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.prepare import Prepared

# Where the Intake leaves the key a request was admitted with (the ASGI scope's state, per request).
SCOPE_KEY = "kvmesh_api_key"


def api_keys(configured: str | None) -> list[str]:
    return [k.strip() for k in (configured or "").split(",") if k.strip()]


def check_api_key(expected: str | None, authorization: str | None) -> str | None:
    """The configured key the request holds (None when no key is configured); a 401 APIError otherwise."""
    keys = api_keys(expected)
    if not keys:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    # Compare bytes of both, against every key, always, so timing says nothing about where a wrong key differs
    # or which key matched.
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    matched = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()) and matched is None:
            matched = key
    if matched is None:
        raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return matched


def tenant_salt(api_key: str, request_salt: str | None) -> str:
    """The cache salt a request of `api_key` runs under: an HMAC keyed by the API key (a secret only that tenant
    and the gateway hold) of the request's own cache_salt, if any. Another tenant can neither name it (an explicit
    cache_salt is scoped the same way) nor compute it; one tenant's requests with one cache_salt share a cache."""
    text = b"kvmesh tenant cache salt\0" + (request_salt.encode() if request_salt is not None else b"\xff")
    return hmac.new(api_key.encode(), text, hashlib.sha256).hexdigest()[:32]


def scoped_to_caller(prepared: Prepared, request: Request) -> Prepared:
    """`prepared` with every sampling's cache salt scoped to the API key its request came with (unchanged when
    the gateway has no keys)."""
    key = request.scope.get("state", {}).get(SCOPE_KEY)
    if key is None:
        return prepared
    samplings = [s.model_copy(update={"cache_salt": tenant_salt(key, s.cache_salt)}) for s in prepared.samplings]
    return dataclasses.replace(prepared, samplings=samplings)
