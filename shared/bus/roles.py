"""Who may say what on the bus: one NATS user per service role, with subject permissions.

Only workers publish block events, load beats and kvstore puts; only the gateway publishes generate
requests and reads load beats; each role reads only its own inboxes (`_INBOX.<role>.*`, set as the
connection's inbox prefix), while any role may publish to an inbox (that is how replies and chunked
uploads travel). `$SRV.>` is nats.micro's discovery (PING/INFO/STATS), answered by every service.
"""
from __future__ import annotations

from shared import subjects as s
from shared.bus.limits import SERVER_MAX_PENDING

ROLES = ("gateway", "tokenizer", "prefill", "decode", "kvstore")
INBOX_ROOT = "_INBOX"
ANY_INBOX = f"{INBOX_ROOT}.>"
SERVICE_DISCOVERY = "$SRV.>"


def inbox_prefix(role: str) -> str:
    return f"{INBOX_ROOT}.{role}"


def _kvstore() -> list[str]:
    return [s.KVSTORE_PUT, s.KVSTORE_GET, s.KVSTORE_CONTAINS, s.KVSTORE_STATS]


def permissions(role: str) -> dict[str, dict[str, list[str]]]:
    """nats-server's permissions block for a role."""
    own_inbox = f"{inbox_prefix(role)}.>"
    publish = {
        "gateway": [s.TOKENIZER_ENCODE, s.TOKENIZER_DECODE, s.DECODE_GENERATE, "kvmesh.decode.generate.*",
                    s.DECODE_CANCEL, s.PREFILL_CANCEL, SERVICE_DISCOVERY],
        "tokenizer": [],
        "decode": ["kvmesh.decode.events.*", s.DECODE_LOAD_ALL, s.PREFILL_PREFILL, s.PREFILL_CANCEL, *_kvstore()],
        "prefill": ["kvmesh.decode.kv.push.*", s.PREFILL_LOAD_ALL, *_kvstore()],
        "kvstore": [s.KVSTORE_EVENTS],
    }[role]
    subscribe = {
        "gateway": [s.DECODE_LOAD_ALL, s.DECODE_EVENTS_ALL, s.PREFILL_LOAD_ALL, s.KVSTORE_EVENTS],
        "tokenizer": [s.TOKENIZER_ENCODE, s.TOKENIZER_DECODE],
        "decode": [s.DECODE_GENERATE, "kvmesh.decode.generate.*", s.DECODE_CANCEL, "kvmesh.decode.kv.push.*"],
        "prefill": [s.PREFILL_PREFILL, s.PREFILL_CANCEL],
        "kvstore": _kvstore(),
    }[role]
    subscribe.append(SERVICE_DISCOVERY)  # every service (the gateway too) answers nats.micro's PING/INFO/STATS
    return {"publish": {"allow": [*publish, ANY_INBOX]}, "subscribe": {"allow": [*subscribe, own_inbox]}}


def password_variable(role: str) -> str:
    """The environment variable that holds a role's password where a file must not (compose)."""
    return f"KVMESH_NATS_{role.upper()}_PASSWORD"


def server_auth_config() -> str:
    """nats-server configuration text for the role users, passwords taken from the server's environment
    (nats-server resolves `$NAME`): compose/nats-auth.conf is this text, and a test keeps it so."""
    import json

    users = []
    for role in ROLES:
        perms = json.dumps(permissions(role), indent=None)
        users.append(f'    {{user: "{role}", password: ${password_variable(role)}, permissions: {perms}}}')
    return ("# Generated from shared/bus/roles.py (tests/test_bus_auth.py checks it): one user per kvmesh role.\n"
            f"max_pending: {SERVER_MAX_PENDING}  # shared/bus/limits.py says why\n"
            "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n")
