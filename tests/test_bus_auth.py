"""The locked-down bus (issue 9 item 3): the nats-server `kvmesh up` starts admits only its role users,
and each role may only publish and subscribe where its work needs. A bare client and clients holding
one role's password try what the issue's attacker did; the server refuses."""
from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import NoServersError

from shared import bus, subjects
from shared.launcher.local_nats import LocalNats, role_passwords
from tests.nats_fixtures import locked_nats, wait_responders


@pytest.fixture
def server(tmp_path):  # noqa: ANN001, ANN201
    with locked_nats(tmp_path, role_passwords()) as srv:
        yield srv


async def _as(srv: LocalNats, role: str | None, errors: list[str]):  # noqa: ANN202
    async def on_error(e: Exception) -> None:
        errors.append(str(e))
    kw = {"user": role, "password": srv.passwords[role]} if role else {}
    return await nats.connect(srv.url, error_cb=on_error, max_reconnect_attempts=0, allow_reconnect=False,
                              inbox_prefix=f"_INBOX.{role or 'anon'}", **kw)


def test_anonymous_and_wrong_password_clients_are_refused(server) -> None:  # noqa: ANN001
    async def go() -> None:
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(server.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(server.url, user="gateway", password="guess", max_reconnect_attempts=0,
                               allow_reconnect=False, connect_timeout=2)
    asyncio.run(go())


def test_roles_cannot_read_or_forge_what_is_not_theirs(server) -> None:  # noqa: ANN001
    async def go() -> list[str]:
        errors: list[str] = []
        gateway = await _as(server, "gateway", errors)
        decode = await _as(server, "decode", errors)
        tokenizer = await _as(server, "tokenizer", errors)
        # The gateway cannot read other clients' prompts, nor the decode role's inboxes.
        await gateway.subscribe(subjects.TOKENIZER_ENCODE)
        await gateway.subscribe("_INBOX.decode.>")
        await gateway.flush()
        # A tokenizer cannot forge a load beat, a generate request or a kvstore put.
        await tokenizer.publish(subjects.decode_load("fake"), b"x")
        await tokenizer.publish(subjects.DECODE_GENERATE, b"x")
        await tokenizer.publish(subjects.KVSTORE_PUT, b"x")
        await tokenizer.flush()
        # A decode worker cannot send generate requests or cancel other clients' streams.
        await decode.publish(subjects.DECODE_GENERATE, b"x")
        await decode.publish(subjects.DECODE_CANCEL, b"x")
        await decode.flush()
        await asyncio.sleep(0.3)
        # What each role needs still works: a decode worker beats, the gateway hears it.
        # (fresh connections: nats-py may drop a subscription when an earlier one on its connection was denied)
        listener, worker = await _as(server, "gateway", []), await _as(server, "decode", [])
        heard = await listener.subscribe(subjects.DECODE_LOAD_ALL)
        await listener.flush()
        msg = None
        for _ in range(50):  # beats repeat; one must get through
            await worker.publish(subjects.decode_load("d0"), b"beat")
            await worker.flush()
            try:
                msg = await heard.next_msg(timeout=0.1)
                break
            except nats.errors.TimeoutError:
                continue
        assert msg is not None and msg.data == b"beat"
        for nc in (gateway, decode, tokenizer, listener, worker):
            await nc.close()
        return errors

    errors = asyncio.run(go())
    violations = [e.lower() for e in errors if "permissions violation" in e.lower()]
    for what in ('subscription to "kvmesh.tokenizer.encode"', 'subscription to "_inbox.decode.>"',
                 'publish to "kvmesh.decode.load.fake"', 'publish to "kvmesh.decode.generate"',
                 'publish to "kvmesh.kvstore.put"', 'publish to "kvmesh.decode.cancel"'):
        assert any(what in v for v in violations), (what, violations)


def test_services_connect_with_their_role_and_inbox(server, monkeypatch) -> None:  # noqa: ANN001
    env = server.role_env("kvstore")
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    async def go() -> str:
        nc = await bus.connect(server.url)
        try:
            return nc.new_inbox()
        finally:
            await nc.close()
    assert asyncio.run(go()).startswith("_INBOX.kvstore.")


def test_compose_auth_config_is_generated_from_the_roles_and_loads_in_nats_server(tmp_path) -> None:  # noqa: ANN001
    import os
    import subprocess
    from pathlib import Path

    from shared.bus.natsd import free_port, nats_server_binary
    from shared.bus.roles import compose_password_variables, server_auth_config

    conf = Path(__file__).resolve().parents[1] / "compose" / "nats-auth.conf"
    assert conf.read_text() == server_auth_config(), "regenerate compose/nats-auth.conf from shared/bus/roles.py"
    port = free_port()
    passwords = {user: f"pw-{user}" for user in compose_password_variables()}
    env = {**os.environ, **{var: passwords[user] for user, var in compose_password_variables().items()}}
    env |= {"KVMESH_NATS_ROUTE_PASSWORD": "pw-route", "KVMESH_NATS_ROUTE_SEED": "nats-route://route:pw-route@127.0.0.1:1"}
    # compose's fixed cluster and monitoring ports moved to free ones (in the file: a --cluster flag would
    # replace the cluster block, its route authorization too)
    local = tmp_path / "nats-auth.conf"
    local.write_text(conf.read_text().replace('"0.0.0.0:6222"', f'"127.0.0.1:{free_port()}"')
                     .replace('"127.0.0.1:8222"', f'"127.0.0.1:{free_port()}"'))
    proc = subprocess.Popen([nats_server_binary(), "-c", str(local), "--addr", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        srv = LocalNats("127.0.0.1", port, 0, passwords)
        assert asyncio.run(srv.wait_ready(15))

        async def go() -> list[str]:
            errors: list[str] = []
            nc = await _as(srv, "tokenizer", errors)
            await nc.subscribe("$SRV.PING")  # quoted "$SRV.>" stays a subject, not a variable
            await nc.subscribe(subjects.TOKENIZER_ENCODE, queue=subjects.QUEUE_TOKENIZER)
            await nc.subscribe(subjects.DECODE_LOAD_ALL)  # not the tokenizer's
            await nc.flush()
            await asyncio.sleep(0.2)
            await nc.close()
            return errors
        errors = asyncio.run(go())
        assert len(errors) == 1 and "kvmesh.decode.load.*" in errors[0], errors
    finally:
        proc.terminate()
        proc.wait(5)


def test_nats_tls_for_the_local_server(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """--nats-tls: the server requires TLS with a certificate of a throwaway CA; services verify it."""
    import subprocess

    srv = LocalNats.on_free_ports(passwords=role_passwords(), config_dir=tmp_path, tls=True)
    proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert asyncio.run(srv.wait_ready(15))
        for k, v in srv.role_env("decode").items():
            monkeypatch.setenv(k, v)

        async def go() -> bytes:
            with pytest.raises((NoServersError, nats.errors.Error, OSError)):  # plain text is refused
                await nats.connect(srv.url, user="decode", password=srv.passwords["decode"], allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2)
            nc = await bus.connect(srv.url)  # the role's env: user, password and the CA
            try:
                assert nc.connected_url is not None
                sub = await nc.subscribe(subjects.DECODE_CANCEL)
                await nc.flush()
                await nc.publish(subjects.decode_load("d0"), b"")  # allowed for the decode role
                await nc.flush()
                return nc._server_info.get("tls_required", False)  # noqa: SLF001
            finally:
                await sub.unsubscribe()
                await nc.close()
        assert asyncio.run(go()) is True
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("locked", [True, False], ids=["roles", "insecure-bus"])
def test_the_mesh_servers_buffer_enough_for_a_busy_kvstore(tmp_path, locked) -> None:  # noqa: ANN001
    """kvmesh up's nats-servers (locked down or not) and compose's config buffer SERVER_MAX_PENDING per
    client before calling it a slow consumer (the default 64 MiB cut the kvstore off under offloads)."""
    import json
    import subprocess
    import urllib.request

    from shared.bus.limits import SERVER_MAX_PENDING
    from shared.bus.roles import server_auth_config

    srv = LocalNats.on_free_ports(passwords=role_passwords() if locked else None, config_dir=tmp_path, monitor=True)
    proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert asyncio.run(srv.wait_ready(15))
        with urllib.request.urlopen(f"{srv.monitor_url}/varz", timeout=5) as r:
            assert json.load(r)["max_pending"] == SERVER_MAX_PENDING > 64 << 20
    finally:
        proc.terminate()
        proc.wait(5)
    assert f"max_pending: {SERVER_MAX_PENDING}" in server_auth_config()


def test_cluster_routes_have_their_own_credential_and_tls(tmp_path) -> None:  # noqa: ANN001
    """Issue 20 item 1: each route authenticates with a generated route password (no service holds it), and
    with --nats-tls the routes use TLS too; the route password never shows in a repr or in argv."""
    import json

    servers = LocalNats.cluster(3, passwords=role_passwords(), config_dir=tmp_path, tls=True)
    for srv in servers:
        cluster = json.loads(srv.write_config().read_text())["cluster"]
        auth = cluster["authorization"]
        assert auth["user"] == "route" and len(auth["password"]) >= 24 and auth["password"] not in srv.passwords.values()
        assert all(r.startswith(f"nats-route://route:{auth['password']}@127.0.0.1:") for r in cluster["routes"])
        assert set(cluster["tls"]) == {"cert_file", "key_file", "ca_file"}
        assert cluster["host"] == "127.0.0.1"
        assert auth["password"] not in repr(srv) and auth["password"] not in " ".join(srv.process().argv)


def test_the_container_health_check_works_as_the_role_without_monitoring(server, monkeypatch) -> None:  # noqa: ANN001
    """Compose's health check of a NATS-only service asks its service's INFO as the container's role user."""
    from shared.launcher.healthcheck import answers_from_here
    from shared.protocol.tokenizer import EncodeRequest

    for k, v in server.role_env("tokenizer").items():
        monkeypatch.setenv(k, v)

    async def go() -> tuple[bool, bool]:
        nc = await bus.connect(server.url)

        async def encode(req, ctx):  # noqa: ANN001, ANN202
            return None
        micro = await bus.add_micro_service(nc, subjects.SERVICE_TOKENIZER, "0.0.1", [
            bus.Endpoint("encode", subjects.TOKENIZER_ENCODE, subjects.QUEUE_TOKENIZER, encode, EncodeRequest)])
        try:
            return await answers_from_here("tokenizer", 2.0, server.url), await answers_from_here("decode", 0.5, server.url)
        finally:
            await micro.stop()
            await nc.close()
    assert asyncio.run(go()) == (True, False)


def test_oversized_requests_and_long_streams_pass_with_response_permissions_only(tmp_path) -> None:  # noqa: ANN001
    """With replies allowed only by `allow_responses` (no publish on `_INBOX.>`), the upload handshake (a
    request over max_payload, both directions being replies) and a long token stream still work, between
    two per-process identities; a third identity cannot write into the stream."""
    import subprocess

    from shared.launcher.local_nats import identity_passwords
    from shared.protocol.generate import GenerateRequest, TokenChunk
    from shared.sampling_params import SamplingParams

    srv = LocalNats.on_free_ports(passwords=identity_passwords(["gateway-0", "decode-0", "decode-1"]), config_dir=tmp_path)
    proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert asyncio.run(srv.wait_ready(15))

        async def go() -> tuple[int, list[int], list[str]]:
            async def as_user(user: str, errors: list[str]):  # noqa: ANN202
                async def on_error(e: Exception) -> None:
                    errors.append(str(e))
                env = srv.role_env(user)
                return await bus.connect(srv.url, user=user, password=env["NATS_PASSWORD"],
                                         inbox_prefix=env["NATS_INBOX_PREFIX"], error_cb=on_error)
            errors: list[str] = []
            gateway, worker, other = [await as_user(u, errors) for u in ("gateway-0", "decode-0", "decode-1")]
            bus.set_sender(worker, "decode-0")
            prompts: list[int] = []

            async def generate(req: GenerateRequest, ctx: bus.RequestContext):  # noqa: ANN202
                prompts.append(len(req.prompt_token_ids))
                await other.publish(ctx.reply, b"forged")  # decode-1 learned the reply subject: refused
                for i in range(3000):
                    yield TokenChunk(request_id=req.request_id, seq=i, token_ids=[i % 100],
                                     finish_reason="length" if i == 2999 else None)
            await bus.serve(worker, subjects.decode_generate("decode-0"), "kvmesh.decode.decode-0", generate,
                            GenerateRequest)
            await worker.flush()
            await wait_responders(gateway, subjects.decode_generate("decode-0"))
            big = list(range(400_000))  # ~1.2 MB of msgpack: over the 1 MiB max_payload, so an upload
            req = GenerateRequest(request_id="r", prompt_token_ids=big, sampling=SamplingParams())
            tokens = []
            async with await bus.request_stream(gateway, subjects.decode_generate("decode-0"), req, timeout=10,
                                                expect=TokenChunk, sender="decode-0") as stream:
                async for c in stream:
                    tokens += c.token_ids
                    if c.finished:
                        break
            await asyncio.sleep(0.2)
            for nc in (gateway, worker, other):
                await nc.close()
            return prompts[0], tokens, errors

        n, tokens, errors = asyncio.run(go())
        assert n == 400_000 and len(tokens) == 3000
        violations = [e for e in errors if "violation" in e.lower()]
        assert len(violations) == 1 and "_inbox.gateway-0" in violations[0].lower(), errors
    finally:
        proc.terminate()
        proc.wait(5)
