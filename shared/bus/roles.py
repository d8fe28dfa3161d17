"""Who may say what on the bus: one NATS user per process (`kvmesh up`), or per engine replica and per other
service role (compose), with subject permissions.

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
# How often, and for how long, a role may answer a reply subject it received (nats-server's allow_responses).
# nats-server keeps every permission until it is used up or expires, and scans the whole map on deliveries once
# it holds more than a few thousand: each role gets what its answers need, no more. A token stream (decode) is
# one reply subject receiving every token chunk, its chunks and the end marker: up to a whole context of tokens,
# for as long as the longest stream the mesh serves. The others answer once (an upload's handshake, the answer
# and its chunks): the kvstore's largest answers (256 MiB of blocks) take a few hundred 1 MiB chunks, a prefill
# worker answers after its longest prefill, the tokenizer and the gateway (nats.micro discovery) at once.
RESPONSES = {"max": 1 << 20, "expires": "1h"}  # decode
ROLE_RESPONSES = {
    "decode": RESPONSES,
    "prefill": {"max": 64, "expires": "30m"},
    "kvstore": {"max": 1024, "expires": "5m"},
    "tokenizer": {"max": 256, "expires": "2m"},
    "gateway": {"max": 4, "expires": "1m"},
}


@dataclass(frozen=True)
class Identity:
    """A bus identity: the NATS user name (also its inbox token), its role and, for an engine worker with
    its own identity, the worker id in its per-worker subjects (None: a shared role user, any id)."""

    user: str
    role: str
    worker_id: str | None = None
    # The models whose subjects it may use (shared/subjects.py namespaces): a worker serves one, the gateway all.
    namespaces: tuple[str, ...] = ("",)

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


def permissions(role: str, worker_id: str | None = None, user: str | None = None,
                namespaces: tuple[str, ...] = ("",)) -> dict[str, object]:
    """nats-server's permissions block for an identity (see Identity; by default the role's shared user), on
    the model-scoped subjects of each of `namespaces` (shared/subjects.py Subjects; "" the first model's)."""
    w = worker_id or "*"
    own_inbox = f"{inbox_prefix(user or role)}.>"
    publish: list[str] = []
    subscribe: list[str] = []
    for ns in namespaces:
        m = s.Subjects(ns)
        publish += {
            "gateway": [m.tokenizer_encode, m.tokenizer_decode, m.decode_generate_any, m.prefill_pool],
            "tokenizer": [],
            "decode": [m.decode_events(w) if w != "*" else m.decode_events_all,
                       m.decode_load(w) if w != "*" else m.decode_load_all,
                       m.decode_suffix(w) if w != "*" else m.decode_suffix_all, m.prefill_prefill],
            "prefill": [m.prefill_load(w) if w != "*" else m.prefill_load_all],
            "kvstore": [],
        }[role]
        subscribe += {
            "gateway": [m.decode_load_all, m.decode_events_all, m.prefill_load_all],
            "tokenizer": [_queued(m.tokenizer_encode, m.queue_tokenizer), _queued(m.tokenizer_decode, m.queue_tokenizer)],
            "decode": [_queued(m.decode_generate_any, m.queue_decode),
                       _queued(f"kvmesh.decode.generate.{w}", f"{m.queue_decode}.{w}"),
                       _queued(f"kvmesh.decode.replay.{w}", f"{m.queue_decode}.{w}"), m.decode_suffix_all],
            "prefill": [_queued(m.prefill_prefill, m.queue_prefill), _queued(m.prefill_pool, m.queue_prefill)],
            "kvstore": [],
        }[role]
    # Subjects every model shares: per-worker subjects (worker ids are unique in the mesh), cancels, the kvstore.
    publish += {
        "gateway": ["kvmesh.decode.generate.*", "kvmesh.decode.replay.*", s.DECODE_CANCEL, s.PREFILL_CANCEL,
                    SERVICE_DISCOVERY, "kvmesh.lora.update.*"],
        "tokenizer": [],
        "decode": [s.PREFILL_CANCEL, *_kvstore()],
        "prefill": ["kvmesh.decode.kv.push.*", *_kvstore()],
        "kvstore": [s.KVSTORE_EVENTS],
    }[role]
    subscribe += {
        "gateway": [s.KVSTORE_EVENTS],
        "tokenizer": [],
        "decode": [s.DECODE_CANCEL, f"kvmesh.decode.kv.push.{w}", f"kvmesh.lora.update.{w}"],
        "prefill": [s.PREFILL_CANCEL, f"kvmesh.lora.update.{w}"],
        "kvstore": [_queued(subject, s.QUEUE_KVSTORE) for subject in _kvstore()],
    }[role]
    subscribe.append(SERVICE_DISCOVERY)  # every service (the gateway too) answers nats.micro's PING/INFO/STATS
    if role == "gateway":  # its input-lag probe goes to its own inbox (services/gateway/input_lag.py)
        publish = [*publish, own_inbox]
    if role != "gateway":  # a container's health check asks its own service's INFO (shared/launcher/healthcheck.py)
        publish = [*publish, f"$SRV.INFO.kvmesh-{role}"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": [*subscribe, own_inbox]},
            "allow_responses": dict(ROLE_RESPONSES[role])}


def identity_permissions(identity: Identity) -> dict[str, object]:
    return permissions(identity.role, identity.worker_id, identity.user, identity.namespaces)


def password_variable(user: str) -> str:
    """The environment variable that holds a user's password where a file must not (compose): a role's
    (KVMESH_NATS_GATEWAY_PASSWORD) or an engine replica's (decode-2: KVMESH_NATS_DECODE_2_PASSWORD)."""
    return f"KVMESH_NATS_{user.upper().replace('-', '_')}_PASSWORD"


# Compose's engine workers, each with its own user: replicas 1-4 of each engine role serve the base file's model
# (docker-compose.yml), 5 the second model's (docker-compose.second-model.yml), 6-8 run on worker machines
# (docker-compose.worker-host.yml). Replicas share no secret, so one replica's password neither reads another's
# requests, pushed KV and inbox replies nor beats under its id.
COMPOSE_REPLICAS = 8


def compose_identities(replicas: int = COMPOSE_REPLICAS) -> list[Identity]:
    """compose/nats-auth.conf's users: the gateway, tokenizer and kvstore roles' shared users (any replica of
    them holds only what every one of them needs), and `<role>-<n>` for each engine replica, whose worker id
    is its user name. Each serves whichever model its container runs: every model's subjects."""
    every = ("", s.ANY_NAMESPACE)
    shared = [Identity(role, role, namespaces=every) for role in ROLES if role not in ENGINE_ROLES]
    return shared + [Identity(f"{role}-{n}", role, f"{role}-{n}", namespaces=every)
                     for role in ENGINE_ROLES for n in range(1, replicas + 1)]


ROUTE_PASSWORD_VARIABLE = "KVMESH_NATS_ROUTE_PASSWORD"
ROUTE_SEED_VARIABLE = "KVMESH_NATS_ROUTE_SEED"  # nats-route://route:<route password>@nats:6222


def server_auth_config() -> str:
    """nats-server configuration text for compose (compose/nats-auth.conf is this text, and a test keeps it
    so): the users of compose_identities(), passwords taken from the server's environment (nats-server resolves `$NAME`); the
    cluster listener, which admits only routes that hold the route password (a whole-value variable holds
    the seed's route URL with it, as nats-server does not expand variables inside strings; the seed's
    route to itself is dropped by nats-server); monitoring on the container's loopback only, for its own
    health check: it lists every connection and subscription."""
    import json

    users = []
    for identity in compose_identities():
        perms = json.dumps(identity_permissions(identity), indent=None)
        users.append(f'    {{user: "{identity.user}", password: ${password_variable(identity.user)}, '
                     f'permissions: {perms}}}')
    return ("# Generated from shared/bus/roles.py (tests/test_bus_auth.py checks it): a user per kvmesh role, and\n"
            f"# one per engine replica (prefill-1..{COMPOSE_REPLICAS}, decode-1..{COMPOSE_REPLICAS}), its worker id.\n"
            f"max_pending: {SERVER_MAX_PENDING}  # shared/bus/limits.py says why\n"
            'http: "127.0.0.1:8222"  # monitoring: inside the container only\n'
            "cluster {\n  name: kvmesh\n  listen: \"0.0.0.0:6222\"  # the compose network (no host port)\n"
            f"  authorization {{ user: route, password: ${ROUTE_PASSWORD_VARIABLE} }}\n"
            f"  routes: [${ROUTE_SEED_VARIABLE}]\n}}\n"
            "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n")


def compose_password_variables() -> dict[str, str]:
    """Every secret compose/nats-auth.conf reads, by the user it belongs to (the route's aside)."""
    return {identity.user: password_variable(identity.user) for identity in compose_identities()}
