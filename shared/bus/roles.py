"""Who may say what on the bus: one NATS user per process (`kvmesh up`) or per service role (compose), with
subject permissions.

Only workers publish block events, load beats and kvstore puts, and an engine worker with its own identity
only for its own id; only the gateway publishes generate requests and reads load beats. Shared
(load-balanced) subjects may be subscribed only in the role's queue group, so no credential reads the
requests other workers serve; a worker's direct subjects only by that worker. Replies travel by
nats-server's `allow_responses`: a process may publish to a reply subject only after it received a message
naming it, and only so many times within a time limit (RESPONSES), so no role may write into another
request's stream. Each identity reads only its own inboxes (`_INBOX.<user>.*`, set as the connection's inbox
prefix). `$SRV.>` is nats.micro's discovery (PING/INFO/STATS), answered by every service.
"""
from __future__ import annotations

from dataclasses import dataclass

from shared import subjects as s
from shared.bus.limits import SERVER_MAX_PENDING

ROLES = ("gateway", "tokenizer", "prefill", "decode", "kvstore")
ENGINE_ROLES = ("prefill", "decode")
INBOX_ROOT = "_INBOX"
SERVICE_DISCOVERY = "$SRV.>"
# A token stream is one reply subject receiving every token chunk, its chunks and the end marker: up to a
# whole context of tokens (chunks carry one or more tokens each), so the count bound is far above any
# context length. The time bound is the longest stream the mesh serves; nats-server forgets a reply
# permission after it (or after the count), which also bounds the server's memory for them.
RESPONSES = {"max": 1 << 20, "expires": "1h"}


@dataclass(frozen=True)
class Identity:
    """A bus identity: the NATS user name (also its inbox token), its role and, for an engine worker with
    its own identity, the worker id in its per-worker subjects (None: a shared role user, any id)."""

    user: str
    role: str
    worker_id: str | None = None

    def __post_init__(self) -> None:
        assert self.role in ROLES, f"unknown role {self.role!r}"
        s.worker_token(self.user)  # the user names an inbox subject token
        if self.worker_id is not None:
            s.worker_token(self.worker_id)

    @classmethod
    def of(cls, user: str) -> Identity:
        """A role name: the role's shared user; `<role>-<n>` (a `kvmesh up` instance name): that process,
        whose worker id (engine workers) is the same name."""
        if user in ROLES:
            return cls(user, user)
        role = user.rsplit("-", 1)[0]
        return cls(user, role, user if role in ENGINE_ROLES else None)

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)


def inbox_prefix(user: str) -> str:
    return f"{INBOX_ROOT}.{user}"


def _kvstore() -> list[str]:
    return [s.KVSTORE_PUT, s.KVSTORE_GET, s.KVSTORE_CONTAINS, s.KVSTORE_STATS]


def _queued(subject: str, queue: str) -> str:
    """nats-server's queue permission: `subject` may be subscribed only as a member of `queue`."""
    return f"{subject} {queue}"


def permissions(role: str, worker_id: str | None = None, user: str | None = None) -> dict[str, object]:
    """nats-server's permissions block for an identity (see Identity; by default the role's shared user)."""
    w = worker_id or "*"
    own_inbox = f"{inbox_prefix(user or role)}.>"
    publish = {
        "gateway": [s.TOKENIZER_ENCODE, s.TOKENIZER_DECODE, s.DECODE_GENERATE, "kvmesh.decode.generate.*",
                    "kvmesh.decode.replay.*", s.DECODE_CANCEL, s.PREFILL_CANCEL, SERVICE_DISCOVERY,
                    "kvmesh.lora.update.*"],
        "tokenizer": [],
        "decode": [f"kvmesh.decode.events.{w}", f"kvmesh.decode.load.{w}", f"kvmesh.decode.suffix.{w}",
                   s.PREFILL_PREFILL, s.PREFILL_CANCEL,
                   *_kvstore()],
        "prefill": ["kvmesh.decode.kv.push.*", f"kvmesh.prefill.load.{w}", *_kvstore()],
        "kvstore": [s.KVSTORE_EVENTS],
    }[role]
    subscribe = {
        "gateway": [s.DECODE_LOAD_ALL, s.DECODE_EVENTS_ALL, s.PREFILL_LOAD_ALL, s.KVSTORE_EVENTS],
        "tokenizer": [_queued(s.TOKENIZER_ENCODE, s.QUEUE_TOKENIZER), _queued(s.TOKENIZER_DECODE, s.QUEUE_TOKENIZER)],
        "decode": [_queued(s.DECODE_GENERATE, s.QUEUE_DECODE),
                   _queued(f"kvmesh.decode.generate.{w}", f"{s.QUEUE_DECODE}.{w}"),
                   _queued(f"kvmesh.decode.replay.{w}", f"{s.QUEUE_DECODE}.{w}"),
                   s.DECODE_CANCEL, f"kvmesh.decode.kv.push.{w}", s.DECODE_SUFFIX_ALL, f"kvmesh.lora.update.{w}"],
        "prefill": [_queued(s.PREFILL_PREFILL, s.QUEUE_PREFILL), s.PREFILL_CANCEL, f"kvmesh.lora.update.{w}"],
        "kvstore": [_queued(subject, s.QUEUE_KVSTORE) for subject in _kvstore()],
    }[role]
    subscribe.append(SERVICE_DISCOVERY)  # every service (the gateway too) answers nats.micro's PING/INFO/STATS
    if role == "gateway":  # its input-lag probe goes to its own inbox (services/gateway/input_lag.py)
        publish = [*publish, own_inbox]
    if role != "gateway":  # a container's health check asks its own service's INFO (shared/launcher/healthcheck.py)
        publish = [*publish, f"$SRV.INFO.kvmesh-{role}"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [*subscribe, own_inbox]},
            "allow_responses": dict(RESPONSES)}


def identity_permissions(identity: Identity) -> dict[str, object]:
    return permissions(identity.role, identity.worker_id, identity.user)


def password_variable(role: str) -> str:
    """The environment variable that holds a role's password where a file must not (compose)."""
    return f"KVMESH_NATS_{role.upper()}_PASSWORD"


ROUTE_PASSWORD_VARIABLE = "KVMESH_NATS_ROUTE_PASSWORD"
ROUTE_SEED_VARIABLE = "KVMESH_NATS_ROUTE_SEED"  # nats-route://route:<route password>@nats:6222


def server_auth_config() -> str:
    """nats-server configuration text for compose (compose/nats-auth.conf is this text, and a test keeps it
    so): the role users, passwords taken from the server's environment (nats-server resolves `$NAME`); the
    cluster listener, which admits only routes that hold the route password (a whole-value variable holds
    the seed's route URL with it, as nats-server does not expand variables inside strings; the seed's
    route to itself is dropped by nats-server); monitoring on the container's loopback only, for its own
    health check: it lists every connection and subscription."""
    import json

    users = []
    for role in ROLES:
        perms = json.dumps(permissions(role), indent=None)
        users.append(f'    {{user: "{role}", password: ${password_variable(role)}, permissions: {perms}}}')
    return ("# Generated from shared/bus/roles.py (tests/test_bus_auth.py checks it): one user per kvmesh role.\n"
            f"max_pending: {SERVER_MAX_PENDING}  # shared/bus/limits.py says why\n"
            'http: "127.0.0.1:8222"  # monitoring: inside the container only\n'
            "cluster {\n  name: kvmesh\n  listen: \"0.0.0.0:6222\"  # the compose network (no host port)\n"
            f"  authorization {{ user: route, password: ${ROUTE_PASSWORD_VARIABLE} }}\n"
            f"  routes: [${ROUTE_SEED_VARIABLE}]\n}}\n"
            "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n")
