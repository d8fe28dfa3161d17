"""`kvmesh up --join FILE`: this host's engine workers join a mesh that another host started.

The host runs its own nats-server(s), routed into the mesh's cluster with the route password derived from the
join file's secret (and TLS signed by the mesh's CA when the bus uses it); its workers connect to their own
host's server, each as its own bus user whose password is derived from the secret and its instance name
(`<role>-<host tag>_<n>`, unique across hosts). The decode workers' direct KV channel listens on
`--advertise-host`, the address the other hosts reach this one at, and every KV transfer between hosts goes
over TCP there (shared memory only between processes of one host). Stopping is `kvmesh up`'s: one Ctrl-C
drains the workers, then the nats-server goes.
"""
from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import ssl
import sys
from dataclasses import replace

import nats

from shared.bus.roles import inbox_prefix
from shared.launcher import mesh_secret
from shared.launcher.host_agent import HostAgent, agent_entry, agent_user
from shared.launcher.join_file import JoinFile
from shared.launcher.join_tls import sign_with_ca
from shared.launcher.local_nats import LocalNats
from shared.launcher.process_spec import ENGINE_SERVICES, MeshOptions, ProcessSpec, ServiceSpec, mesh_services
from shared.launcher.secrets_dir import secrets_dir
from shared.launcher.supervisor import Emit, Supervisor, describe_exit, print_line
from shared.planner.scaler import SupervisorScaler
from shared.service_runner import DEFAULT_GRACE_S

JOINED = "joined the mesh"  # tests wait for this line
ROUTE_WAIT_S = 30.0
DRAIN_MARGIN_S = 10.0


def host_tag(name: str | None = None) -> str:
    """This host's tag in its instance names: letters, digits and `_` only (a `-` would split the role)."""
    tag = re.sub(r"[^A-Za-z0-9_]", "_", name or socket.gethostname().split(".")[0])[:24].strip("_")
    return tag or "host"


def joined_specs(opts: MeshOptions, join: JoinFile, counts: dict[str, int], tag: str) -> dict[str, ServiceSpec]:
    """This host's engine worker kinds (the gateway, tokenizer and kvstore run where the mesh started), configured
    as the mesh's: its model id, its kvstore, remote prefill when any host has prefill workers; `counts`:
    role -> instances (bus identities) this host may run."""
    base = replace(opts, decode=max(counts["decode"], 1), prefill=counts["prefill"] + join.prefill,
                   kvstore=1 if join.kvstore else 0, served_model_name=opts.served_model_name or join.served_model_name)
    return {s.service: replace(s, replicas=counts[s.service], host_tag=tag) for s in mesh_services(base)
            if s.service in ENGINE_SERVICES}


def instance(spec: ServiceSpec, index: int) -> ProcessSpec:
    argv = (sys.executable, "-m", spec.module, *spec.args, *spec.instance_args(index))
    return ProcessSpec(spec.instance_name(index), argv, {**spec.env, **spec.instance_env(index)})


def joined_services(opts: MeshOptions, join: JoinFile, prefill: int, decode: int, tag: str) -> list[ProcessSpec]:
    """The processes this host starts with."""
    counts = {"prefill": prefill, "decode": decode}
    specs = joined_specs(opts, join, counts, tag)
    return [instance(specs[role], i) for role in ("prefill", "decode") for i in range(counts[role])]


async def run_joined(opts: MeshOptions, join: JoinFile, advertise_host: str, tag: str, prefill: int, decode: int,
                     grace: float | None, nats_servers: int = 1, emit: Emit = print_line,
                     most: dict[str, int] | None = None) -> int:
    """most: role -> the most workers the first host's planner may ask this host to run (bus identities are
    made for that many); None: just the ones it starts with."""
    with secrets_dir() as secrets:
        loop = asyncio.get_running_loop()
        stop, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            (hurry if stop.is_set() else stop).set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        limits = {r: max(n, (most or {}).get(r, 0)) for r, n in (("prefill", prefill), ("decode", decode))}
        full = joined_specs(opts, join, limits, tag)
        identities = [full[r].instance_name(i) for r in limits for i in range(limits[r])]
        names = [full[r].instance_name(i) for r, n in (("prefill", prefill), ("decode", decode)) for i in range(n)]
        agent_password = mesh_secret.process_password(join.secret, agent_user(tag))
        tls = sign_with_ca(secrets, join.tls_ca, join.tls_ca_key, advertise_host) if join.tls_ca and join.tls_ca_key \
            else None
        cluster = LocalNats.cluster(
            nats_servers, advertise_host,
            passwords=mesh_secret.process_passwords(join.secret, identities) if join.secure_bus else None,
            config_dir=secrets, route_password=mesh_secret.route_password(join.secret), seed_routes=join.routes,
            tls_files=tls, extra_users=(agent_entry(tag, agent_password),) if join.secure_bus else ())
        cluster = [replace(s, name=f"nats-{tag}" if len(cluster) == 1 else f"nats-{tag}_{i}")
                   for i, s in enumerate(cluster)]
        supervisor = Supervisor(emit)
        for server in cluster:
            await supervisor.start(server.process())
        servers = [s.name for s in cluster]
        for server in cluster:
            if not await server.wait_ready(timeout=15):
                emit(f"[kvmesh] {server.name} did not start")
                await supervisor.stop(servers, timeout=5)
                return 1
        if not await _wait_routed(cluster[0], ROUTE_WAIT_S, stop):
            emit(f"[kvmesh] {cluster[0].name} has no route to the mesh after {ROUTE_WAIT_S:g}s (is "
                 f"{', '.join(join.routes)} reachable from {advertise_host}?); it keeps trying")
        nats_url = ",".join(s.url for s in cluster)
        env = {"NATS_URL": nats_url, "KVMESH_KV_HOST": advertise_host}
        if grace is not None:
            env["KVMESH_GRACE_S"] = str(grace)
        salt = mesh_secret.cache_salt(join.secret)

        def process_for(role: str, index: int) -> ProcessSpec:
            proc = instance(full[role], index)
            return replace(proc, env={**proc.env, **env, "KVMESH_CACHE_SALT": salt, **cluster[0].role_env(proc.name)})

        for role, n in (("prefill", prefill), ("decode", decode)):
            for i in range(n):
                await supervisor.start(process_for(role, i))
        timeout = (grace if grace is not None else DEFAULT_GRACE_S) + DRAIN_MARGIN_S
        scaler = SupervisorScaler(supervisor, process_for, {"prefill": list(range(prefill)),
                                                            "decode": list(range(decode))}, limits, timeout)
        agent = HostAgent(await _agent_connection(cluster[0], tag, agent_password if join.secure_bus else None),
                          tag, scaler)
        await agent.start()
        emit(f"[kvmesh] {JOINED} from {advertise_host} as host {tag}: {', '.join(names)} (nats {nats_url}, "
             f"routes to {', '.join(join.routes)}); Ctrl-C stops them")
        await stop.wait()
        emit("[kvmesh] stopping (Ctrl-C again to kill)")
        await agent.stop()
        workers = [n for n in supervisor.children if n not in servers]
        codes = await supervisor.stop(workers, timeout=timeout, hurry=hurry)
        unclean = {n: c for n, c in codes.items() if c not in (0, None, -signal.SIGTERM)}
        for name, code in unclean.items():
            emit(f"[kvmesh] {name} did not stop cleanly: {describe_exit(code)}")  # type: ignore[arg-type]
        await supervisor.stop(servers, timeout=5)
        return 1 if unclean else 0


async def _agent_connection(server: LocalNats, tag: str, password: str | None):  # noqa: ANN202 - nats Client
    kwargs: dict = {"servers": [server.url], "name": agent_user(tag), "max_reconnect_attempts": -1}
    if password is not None:
        kwargs |= {"user": agent_user(tag), "password": password, "inbox_prefix": inbox_prefix(agent_user(tag))}
    if server.tls:
        kwargs["tls"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(server.tls.ca))
    return await nats.connect(**kwargs)


async def _wait_routed(server: LocalNats, timeout: float, stop: asyncio.Event) -> bool:
    """Until the server has a route to another server of the mesh, or timeout. Monitoring is off by default
    (it lists every connection and inbox), so the sign is the server's INFO greeting: once routed, it offers
    the other servers' client URLs (`connect_urls`) beside its own."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    own = f"{server.host}:{server.port}"
    while loop.time() < deadline and not stop.is_set():
        if any(url != own for url in await _connect_urls(server)):
            return True
        await asyncio.sleep(0.2)
    return False


async def _connect_urls(server: LocalNats) -> list[str]:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(server.host, server.port), 2.0)
    except (OSError, asyncio.TimeoutError):
        return []
    try:
        line = await asyncio.wait_for(reader.readline(), 2.0)
        info = json.loads(line.removeprefix(b"INFO").strip() or b"{}")
        return list(info.get("connect_urls") or [])
    except (OSError, ValueError, asyncio.TimeoutError):
        return []
    finally:
        writer.close()


