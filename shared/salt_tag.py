"""A one-way tag of the mesh's cache salt: lets a service that must not hash blocks (the kvstore) tell whether
the records it keeps were made under the current secret, without being able to hash with it."""
from __future__ import annotations

import hashlib


def salt_tag(cache_salt: str) -> str:
    return hashlib.sha256(b"kvmesh kvstore disk records\0" + cache_salt.encode()).hexdigest()[:32]
