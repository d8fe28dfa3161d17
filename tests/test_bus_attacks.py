"""Issue 20's attacks on a real, locked-down `kvmesh up` (two decode workers, real nats-server), each made by
a bare NATS client holding one leaked credential of the mesh (read from the launcher's own secrets
directory, as a process of the same user could): the attack must fail, the mesh must keep serving.

  * a decode credential reads every prompt (subscribes to the generate subjects without a queue group);
  * a tokenizer credential reads every prompt (the encode subject without its queue group);
  * a decode credential beats for the other worker (a full queue): every request failed with 503;
  * a decode credential writes into a victim's token stream (its reply inbox, found in the monitoring
    page's subscription list): a forged end made the victim's request a 500, a forged first chunk with
    finish "stop" gave it attacker-chosen text with a 200;
  * a decode credential floods block events for made-up worker ids.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import time
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest

from shared import subjects, wire
from shared.bus import headers as H
from shared.bus.natsd import free_port
from shared.protocol.events import BlockStored, LoadBeat
from shared.protocol.generate import TokenChunk
from shared.launcher.up import READY
from services.kvstore.disk_tier import SALT_TAG_FILE, DiskTier
from shared.salt_tag import salt_tag
from tests.test_kvstore_disk import _chain
from tests.test_launcher import ROOT, Lines, _env

EARLIER_SALT = "an earlier mesh's secret"


@dataclass
class LockedMesh:
    base: str  # the gateway's URL
    nats_url: str
    monitor_url: str
    users: dict[str, str]  # NATS user -> password, from the server's config
    out: Lines
    disk: Path | None = None  # the kvstore's disk tier, seeded with an earlier mesh's records (another secret)

    def user(self, role: str) -> str:
        """The first user of `role`: its worker 0 (one identity per process) or the role's shared user."""
        return sorted(u for u in self.users if u == role or u.startswith(f"{role}-"))[0]

    async def connect(self, user: str, errors: list[str]) -> nats.NATS:
        async def on_error(e: Exception) -> None:
            errors.append(str(e))
        return await nats.connect(self.nats_url, user=user, password=self.users[user], error_cb=on_error,
                                  allow_reconnect=False, max_reconnect_attempts=0, inbox_prefix=f"_INBOX.{user}")

    def complete(self, prompt: str, max_tokens: int = 8, **kw: object) -> httpx.Response:
        body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
        return httpx.post(f"{self.base}/v1/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[LockedMesh]:  # noqa: ANN001
    from shared.models.demo import build_demo_model

    tmp = tmp_path_factory.mktemp("attacks")
    model = build_demo_model(tmp / "demo")
    secrets_root = tmp / "tmp"  # the launcher's secrets directory is made here (TMPDIR)
    secrets_root.mkdir()
    disk = tmp / "kv"
    old = DiskTier(disk, 1 << 20, salt_tag=salt_tag(EARLIER_SALT))  # what a previous run left there
    old.put(_chain(3))
    old.close()
    os.chmod(disk, 0o755)  # as an older kvmesh made it
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--model", str(model), "--port", str(port), "--grace", "5",
         "--startup-timeout", "120", "--decode", "2", "--prefill", "0", "--kvstore", "1",
         "--kvstore-disk-dir", str(disk), "--served-model-name", "demo", "--nats-monitor"],  # the inbox test reads /connz as a snooper would
        cwd=ROOT, env=_env(TMPDIR=str(secrets_root)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = Lines(proc.stdout)
        base = out.wait_for(rf"{READY} (http://\S+)/v1", timeout=150)[1]
        m = out.wait_for(r"nats at (\S+) \(monitoring (\S+);", timeout=5)
        (conf,) = secrets_root.glob("kvmesh-up-*/nats.json")
        users = {u["user"]: u["password"] for u in json.loads(conf.read_text())["authorization"]["users"]}
        yield LockedMesh(base, m[1], m[2], users, out, disk)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _violations(errors: list[str]) -> list[str]:
    return [e for e in errors if "permissions violation" in e.lower()]


def test_a_decode_credential_cannot_read_other_workers_prompts(mesh: LockedMesh) -> None:
    async def attack() -> tuple[int, list[str]]:
        errors: list[str] = []
        nc = await mesh.connect(mesh.user("decode"), errors)
        seen: list[str] = []

        async def record(msg) -> None:  # noqa: ANN001
            seen.append(msg.subject)
        for subject in (subjects.DECODE_GENERATE, "kvmesh.decode.generate.*", "kvmesh.decode.generate.decode-1"):
            sub_nc = await mesh.connect(mesh.user("decode"), errors)  # a denied subscription may take its connection's others
            await sub_nc.subscribe(subject, cb=record)
            await sub_nc.flush()
        # And in the other worker's queue group on its direct subject: half its requests would come here.
        await nc.subscribe("kvmesh.decode.generate.decode-1", queue="kvmesh.decode.decode-1",
                           cb=record)
        await nc.flush()
        await asyncio.sleep(0.3)
        for i in range(6):
            r = await asyncio.to_thread(mesh.complete, f"secret prompt number {i}", 4)
            assert r.status_code == 200, r.text
        await asyncio.sleep(0.3)
        return len(seen), errors

    seen, errors = asyncio.run(attack())
    assert seen == 0, f"the attacker read {seen} generate requests"
    assert len(_violations(errors)) >= 3, errors


def test_a_tokenizer_credential_cannot_read_or_answer_prompts_outside_its_queue_group(mesh: LockedMesh) -> None:
    async def attack() -> tuple[list[bytes], list[str]]:
        errors: list[str] = []
        nc = await mesh.connect(mesh.user("tokenizer"), errors)
        seen: list[bytes] = []

        async def rewrite(msg) -> None:  # noqa: ANN001
            seen.append(msg.data)
            if msg.reply:  # answer first with other tokens: the prompt would be rewritten
                try:
                    await nc.publish(msg.reply, b"forged")
                except Exception:  # noqa: BLE001
                    pass
        await nc.subscribe(subjects.TOKENIZER_ENCODE, cb=rewrite)
        await nc.flush()
        await asyncio.sleep(0.3)
        for i in range(3):
            r = await asyncio.to_thread(mesh.complete, f"tokenizer secret {i}", 4)
            assert r.status_code == 200, r.text
        return seen, errors

    seen, errors = asyncio.run(attack())
    assert not any(b"tokenizer secret" in d for d in seen), "the attacker read prompts on the encode subject"
    assert _violations(errors), errors


def test_a_decode_credential_cannot_beat_for_another_worker(mesh: LockedMesh) -> None:
    """Forged beats claiming both workers' queues are full, 100 a second while requests come in."""
    async def attack() -> tuple[list[int], list[str]]:
        errors: list[str] = []
        attacker = mesh.user("decode")
        stop = asyncio.Event()
        conns = {wid: await mesh.connect(attacker, errors) for wid in ("decode-0", "decode-1")}

        async def forge() -> None:
            while not stop.is_set():
                for wid, nc in conns.items():
                    beat = LoadBeat(worker_id=wid, running=0, waiting=1 << 20, free_blocks=0, total_blocks=64,
                                    block_size=16)
                    try:
                        await nc.publish(subjects.decode_load(wid), wire.encode(beat))
                    except Exception:  # noqa: BLE001 - a closed connection: the server refused
                        pass
                await asyncio.sleep(0.01)
        task = asyncio.ensure_future(forge())
        await asyncio.sleep(0.5)
        codes = []
        for i in range(8):
            r = await asyncio.to_thread(mesh.complete, f"beats {i}", 2)
            codes.append(r.status_code)
        stop.set()
        await task
        return codes, errors

    codes, errors = asyncio.run(attack())
    assert codes == [200] * len(codes), codes
    assert any("kvmesh.decode.load.decode-1" in v for v in _violations(errors)), errors


def test_a_decode_credential_cannot_write_into_a_victims_stream(mesh: LockedMesh) -> None:
    """The attacker finds the gateway's reply inboxes in the monitoring page's subscription list (or would
    learn one from a request it sees) and sends a forged end of stream and a forged first chunk."""
    prompt = "The victim asks a question and expects"
    honest = mesh.complete(prompt, 48, ignore_eos=True)
    assert honest.status_code == 200
    results: list[httpx.Response] = []
    done = threading.Event()

    def victims() -> None:
        try:
            for _ in range(4):
                results.append(mesh.complete(prompt, 48, ignore_eos=True))
        finally:
            done.set()

    async def attack() -> tuple[int, list[str]]:
        errors: list[str] = []
        nc = await mesh.connect(mesh.user("decode"), errors)
        forged = 0
        seen: set[str] = set()
        while not done.is_set():
            conns = httpx.get(f"{mesh.monitor_url}/connz", params={"subs": 1}, timeout=5).json()["connections"]
            inboxes = {s for c in conns for s in c.get("subscriptions_list") or [] if s.startswith("_INBOX.gateway")}
            for inbox in inboxes - seen:
                seen.add(inbox)
                chunk = TokenChunk(request_id="", seq=0, token_ids=[1, 2, 3], finish_reason="stop")
                try:
                    await nc.publish(inbox, wire.encode(chunk), headers={H.SEQ: "0"})
                    await nc.publish(inbox, b"", headers={H.END: "0"})
                    forged += 1
                except Exception:  # noqa: BLE001 - the server closed the connection on a violation
                    nc = await mesh.connect(mesh.user("decode"), errors)
            await asyncio.sleep(0.005)
        return forged, errors

    t = threading.Thread(target=victims)
    t.start()
    forged, errors = asyncio.run(attack())
    t.join()
    assert forged >= 1, "the attack never found a victim's inbox"
    assert [r.status_code for r in results] == [200] * 4, [r.text[:200] for r in results]
    assert all(r.json()["choices"][0]["text"] == honest.json()["choices"][0]["text"] for r in results)
    assert _violations(errors), errors


def test_a_decode_credential_cannot_flood_events_for_other_ids(mesh: LockedMesh) -> None:
    async def attack() -> list[str]:
        errors: list[str] = []
        nc = await mesh.connect(mesh.user("decode"), errors)
        for i in range(5):
            try:
                await nc.publish(subjects.decode_events(f"made-up-{i}"),
                                 wire.encode(BlockStored(worker_id=f"made-up-{i}", hashes=[bytes(16)] * 100)))
            except Exception:  # noqa: BLE001
                nc = await mesh.connect(mesh.user("decode"), errors)
        await nc.flush()
        await asyncio.sleep(0.3)
        return errors

    errors = asyncio.run(attack())
    assert any("kvmesh.decode.events.made-up" in v for v in _violations(errors)), errors
    assert mesh.complete("still serving", 2).status_code == 200


def test_the_salt_goes_only_to_engine_workers_and_no_secret_is_in_argv(mesh: LockedMesh) -> None:
    """Issue 20 item 6 and the secrets rule, read from the running processes as any process of this user can."""
    pids = {m[1]: int(m[2]) for line in mesh.out.lines if (m := re.search(r"^\[kvmesh\] started (\S+) \(pid (\d+)\)", line))}
    assert {"nats", "tokenizer-0", "decode-0", "decode-1", "gateway-0"} <= set(pids)
    salt = None
    for name, pid in pids.items():
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        assert ("KVMESH_CACHE_SALT" in env) == name.startswith(("decode", "prefill")), name
        salt = env.get("KVMESH_CACHE_SALT", salt)
        if name != "nats":  # each process holds its own password only
            assert env["NATS_USER"] == name and env["NATS_PASSWORD"] == mesh.users[name]
        argv = Path(f"/proc/{pid}/cmdline").read_text()
        assert not any(pw in argv for pw in mesh.users.values()) and (salt is None or salt not in argv), name
    assert salt
    log = "\n".join(mesh.out.lines)
    assert salt not in log and not any(pw in log for pw in mesh.users.values())


def test_a_decode_credential_cannot_send_its_own_oversized_beats(mesh: LockedMesh) -> None:
    """A worker's own beat with a 150,000-entry list, which /metrics would render on the gateway's event loop:
    refused (beats are small and never chunked), the gateway's /metrics and requests unaffected."""
    worker = mesh.user("decode")
    huge = LoadBeat.model_construct(**{**LoadBeat(worker_id=worker, running=0, waiting=0, free_blocks=64,
                                                  total_blocks=64).model_dump(),
                                       "spec_num_drafts": 1,  # the per-position counts are rendered
                                       "spec_num_accepted_tokens_per_pos": list(range(150_000))})

    async def attack() -> list[str]:
        errors: list[str] = []
        nc = await mesh.connect(worker, errors)
        rendered = []
        for _ in range(10):
            await nc.publish(subjects.decode_load(worker), wire.encode(huge))
            await nc.flush()
            await asyncio.sleep(0.05)
            r = await asyncio.to_thread(httpx.get, f"{mesh.base}/metrics", timeout=30)
            rendered.append(r.text)
        await nc.close()
        return rendered

    rendered = asyncio.run(attack())
    assert not any('position="149999"' in text for text in rendered), "the gateway took the oversized beat"
    assert mesh.complete("still serving", 4).status_code == 200


def test_the_kvstore_disk_tier_is_private_and_holds_no_dead_prompts(mesh: LockedMesh) -> None:
    """Another local user must read no cached prompt from the disk tier (layer-0 V rows give the tokens back),
    and records of an earlier mesh's secret, which can never be hit again, are wiped at start."""
    tag = mesh.disk / SALT_TAG_FILE
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and tag.read_text().strip() == salt_tag(EARLIER_SALT):
        time.sleep(0.2)
    current = tag.read_text().strip()
    assert current != salt_tag(EARLIER_SALT), "the kvstore kept an earlier mesh's records"
    assert stat.S_IMODE(os.stat(mesh.disk).st_mode) == 0o700
    assert [p.name for p in mesh.disk.iterdir() if not p.name.startswith(".")] == [SALT_TAG_FILE], \
        "an earlier mesh's records are still on disk"
    assert stat.S_IMODE(os.stat(tag).st_mode) == 0o600


# ------------------------------------------------------------------------------- cluster routes (item 1)


@pytest.fixture(scope="module")
def cluster_mesh(tmp_path_factory) -> Iterator[tuple[LockedMesh, Path]]:  # noqa: ANN001
    from shared.models.demo import build_demo_model

    tmp = tmp_path_factory.mktemp("routes")
    model = build_demo_model(tmp / "demo")
    secrets_root = tmp / "tmp"
    secrets_root.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--model", str(model), "--port", str(free_port()), "--grace", "5",
         "--startup-timeout", "120", "--prefill", "0", "--kvstore", "0", "--served-model-name", "demo",
         "--nats-servers", "3"],
        cwd=ROOT, env=_env(TMPDIR=str(secrets_root)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = Lines(proc.stdout)
        base = out.wait_for(rf"{READY} (http://\S+)/v1", timeout=150)[1]
        m = out.wait_for(r"nats-0 at (\S+) \(monitoring (\S+);", timeout=5)
        (conf,) = secrets_root.glob("kvmesh-up-*/nats-0.json")
        users = {u["user"]: u["password"] for u in json.loads(conf.read_text())["authorization"]["users"]}
        yield LockedMesh(base, m[1], m[2], users, out), conf
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_passwordless_server_cannot_route_into_the_cluster(cluster_mesh, tmp_path) -> None:  # noqa: ANN001
    """A local process finds a route port (listening ports are visible to every user), starts its own open
    nats-server routed to it, and with no credentials at all listens on the tokenizer subject there."""
    from shared.bus.natsd import NatsServer

    mesh, conf = cluster_mesh
    route_port = json.loads(conf.read_text())["cluster"]["port"]
    rogue = NatsServer(workdir=tmp_path, cluster_port=free_port(), routes=(f"nats-route://127.0.0.1:{route_port}",))
    with rogue:
        async def attack() -> tuple[int, int]:
            nc = await nats.connect(rogue.url)  # the rogue server is open: no credentials
            seen: list[bytes] = []

            async def record(msg) -> None:  # noqa: ANN001
                seen.append(msg.data)
            await nc.subscribe(subjects.TOKENIZER_ENCODE, cb=record)
            await nc.subscribe("kvmesh.>", cb=record)
            await nc.flush()
            await asyncio.sleep(2.0)  # routes connect within a second
            for i in range(3):
                r = await asyncio.to_thread(mesh.complete, f"routed secret {i}", 2)
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
            await nc.close()
            routes = httpx.get(f"http://127.0.0.1:{rogue.http_port}/routez", timeout=5).json()["num_routes"]
            return len(seen), routes

        seen, routes = asyncio.run(attack())
    assert (seen, routes) == (0, 0), f"the rogue server got {routes} routes and read {seen} messages"
    # No monitoring pages unless asked for (--nats-monitor; they list every inbox to any local user).
    assert mesh.monitor_url == "off"
