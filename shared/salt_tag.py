"""A one-way tag of the mesh's cache salt: lets a service that must not hash blocks (the kvstore) tell whether
the records it keeps were made under the current secret, without being able to hash with it."""
from __future__ import annotations

import hashlib
import hmac
import secrets


def salt_tag(cache_salt: str) -> str:
    return hashlib.sha256(b"kvmesh kvstore disk records\0" + cache_salt.encode()).hexdigest()[:32]


def model_salts(base: str | None, models: int) -> list[str]:
    """One cache salt a model. With the user's own secret (KVMESH_CACHE_SALT) the first model uses it and the
    others derive theirs from it, so every model's disk records stay usable across runs; without one, each
    model gets a fresh random salt."""
    if base is None:
        return [secrets.token_hex(16) for _ in range(models)]
    return [base] + [hmac.new(base.encode(), f"kvmesh model {i}".encode(), hashlib.sha256).hexdigest()[:32]
                     for i in range(1, models)]
