"""Credentials derived from a mesh's secret, so that hosts agree on them without sending any of them.

Each is HMAC-SHA256(secret, purpose): a process's password is keyed by its user name (its instance name,
unique across the mesh because a joined host tags its instances with its host name), so one leaked password
speaks for one process only and says nothing about the others or the secret. The route password admits
a nats-server into the cluster; the cache salt is folded into every block hash (the same on every host, or
no prefix could be shared between hosts).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


def new_secret() -> str:
    return secrets.token_hex(32)


def derive(secret: str, purpose: str) -> str:
    digest = hmac.new(bytes.fromhex(secret), purpose.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def process_password(secret: str, user: str) -> str:
    return derive(secret, f"user:{user}")


def route_password(secret: str) -> str:
    return derive(secret, "route")


def cache_salt(secret: str) -> str:
    return hashlib.sha256(derive(secret, "cache-salt").encode()).hexdigest()[:32]


def process_passwords(secret: str, users: list[str]) -> dict[str, str]:
    return {user: process_password(secret, user) for user in users}
