"""The launcher: its spec vs compose/docker-compose.yml, `kvmesh serve`, the supervisor's
restarts and `kvmesh up` end to end (real nats-server, real service processes)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from shared.bus.natsd import NatsServer, free_port
from shared.launcher import healthcheck
from shared.launcher.readiness import wait_healthy
from shared.launcher.process_spec import NEVER_REMOTE, SERVICE_ENV, SERVICES, MeshOptions, ProcessSpec, mesh_services
from shared.launcher.supervisor import Backoff, Supervisor
from shared.launcher.up import READY

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"
WORKERS = ("tokenizer", "prefill", "decode", "kvstore")
# What compose runs, as `kvmesh up` options (the header of docker-compose.yml says the same).
COMPOSE_OPTIONS = MeshOptions(model="/model", host="0.0.0.0", port=8000, served_model_name="demo")


def _interpolate(value: object) -> object:
    """Compose's `${VAR:-default}` with the defaults (the test must not depend on the caller's env)."""
    if isinstance(value, str):
        return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


def _load(name: str) -> dict:
    return _interpolate(yaml.safe_load((COMPOSE / name).read_text()))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


# ---------------------------------------------------------------- compose vs spec (static)


def test_compose_runs_the_launcher_services(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"nats", "nats-2", "nats-3", "jaeger", "prometheus", "grafana", *SERVICES}
    assert services["nats-2"]["profiles"] == services["nats-3"]["profiles"] == ["cluster"]
    for spec in mesh_services(COMPOSE_OPTIONS):
        svc = services[spec.service]
        assert svc["command"] == ["python", "-m", spec.module, *spec.args], spec.service
        assert svc.get("deploy", {}).get("replicas", 1) == spec.replicas
        env = svc["environment"]
        for key, value in spec.env.items():
            assert env.get(key) == value, (spec.service, key)
        assert env["NATS_URL"] == "nats://nats:4222"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
        assert "/model:ro" in [v.split(":", 1)[1] for v in svc["volumes"]], spec.service
        check = svc["healthcheck"]["test"]
        assert check[:4] == ["CMD", "python", "-m", "shared.launcher.healthcheck"] and check[4] == spec.service
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        assert svc["build"]["dockerfile"] == "compose/Dockerfile"


def test_compose_flags_agree_with_spec_details(compose: dict) -> None:
    by_name = {s.service: s for s in mesh_services(COMPOSE_OPTIONS)}
    for name in ("tokenizer", "prefill", "decode", "gateway"):
        cmd = compose["services"][name]["command"]
        assert cmd[cmd.index("--model") + 1] == "/model"
    # Same remote-prefill policy (the decode default) in both; no fixed worker id, so decode scales.
    decode = compose["services"]["decode"]["command"]
    assert ("--remote-prefill-threshold" in decode) == ("--remote-prefill-threshold" in by_name["decode"].args)
    assert "--worker-id" not in decode
    assert SERVICE_ENV.items() <= compose["services"]["kvstore"]["environment"].items()


def test_compose_workers_scale(compose: dict) -> None:
    for name in WORKERS:
        svc = compose["services"][name]
        assert "container_name" not in svc and "ports" not in svc and "hostname" not in svc, name
    assert "container_name" not in compose["services"]["gateway"]


def test_compose_infrastructure(compose: dict) -> None:
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:")
    assert nats["command"] == ["--config", "/etc/nats/auth.conf", "--server_name", "nats"]  # the rest: nats-auth.conf
    assert "healthcheck" in nats
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    published = {p.split(":")[-1] for p in jaeger["ports"]}
    assert {"4317", "4318", "16686"} <= published


def test_compose_monitoring(compose: dict) -> None:
    prom = compose["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["static_configs"][0]["targets"] == ["gateway:8000"] and scrape["metrics_path"] == "/metrics"
    grafana = compose["services"]["grafana"]
    for volume in grafana["volumes"]:
        assert (COMPOSE / volume.split(":")[0]).is_dir(), volume
    datasource = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_gpu_overlay() -> None:
    gpu = _load("docker-compose.gpu.yml")["services"]
    assert set(gpu) == {"prefill", "decode"}
    for svc in gpu.values():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert "cu" in svc["build"]["args"]["TORCH_INDEX_URL"]


def test_dockerfile() -> None:
    text = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r"^FROM python:[\d.]+-slim$", text, re.M)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    assert re.search(r"^RUN pip install \.", text, re.M)


# ---------------------------------------------------------------- spec


def test_spec_processes() -> None:
    opts = MeshOptions(model="m", prefill=2, decode=3, tokenizer=2, kvstore=0, remote_prefill_threshold=0)
    procs = [p for s in mesh_services(opts) for p in s.processes("py", {"NATS_URL": "nats://x:1"})]
    names = [p.name for p in procs]
    assert names == ["tokenizer-0", "tokenizer-1", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "gateway-0"]
    decode2 = procs[names.index("decode-2")]
    assert decode2.argv[:3] == ("py", "-m", "services.decode")
    assert decode2.argv[-2:] == ("--worker-id", "decode-2")
    assert "--remote-prefill-threshold" in decode2.argv and decode2.argv[decode2.argv.index("--remote-prefill-threshold") + 1] == "0"
    assert "--remote-prefill-timeout-per-token" not in decode2.argv  # decode's own default, by its device
    (decode,) = [s for s in mesh_services(MeshOptions(remote_prefill_timeout_per_token=0.05)) if s.service == "decode"]
    assert decode.args[decode.args.index("--remote-prefill-timeout-per-token") + 1] == "0.05"
    with pytest.raises(AssertionError):
        MeshOptions(remote_prefill_timeout_per_token=0)
    assert all(p.env["NATS_URL"] == "nats://x:1" and p.env["PYTHONUNBUFFERED"] == "1" for p in procs)
    # Without prefill workers nothing may go remote.
    (decode,) = [s for s in mesh_services(MeshOptions(prefill=0)) if s.service == "decode"]
    assert decode.args[decode.args.index("--remote-prefill-threshold") + 1] == str(NEVER_REMOTE)
    with pytest.raises(AssertionError):
        MeshOptions(decode=0)
    # One model name across the engines and the gateway (it seeds block hashes); no kvstore: engines skip it.
    args = {s.service: s.args for s in mesh_services(MeshOptions(served_model_name="x", kvstore=0))}
    for name in ("prefill", "decode", "gateway"):
        assert args[name][args[name].index("--served-model-name") + 1] == "x"
    assert "--served-model-name" not in args["tokenizer"]
    assert "--no-kvstore" in args["prefill"] and "--no-kvstore" in args["decode"] and args["kvstore"] == ()


def test_backoff() -> None:
    b = Backoff(initial=1, maximum=5, reset_after=10)
    delays = [None]
    for _ in range(5):
        delays.append(b.next(delays[-1], uptime=0.1))
    assert delays[1:] == [1, 2, 4, 5, 5]
    assert b.next(5, uptime=11) == 1


def test_up_refuses_missing_services(monkeypatch, capsys) -> None:
    import argparse

    from shared.launcher import up

    monkeypatch.setattr(up, "missing_services", lambda: ["decode"])
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    assert up.run(parser.parse_args([])) == 2
    assert "services.decode (services/decode/__main__.py)" in capsys.readouterr().err


def test_up_refuses_a_busy_port(capsys) -> None:
    import argparse
    import socket

    from shared.launcher import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert up.run(parser.parse_args(["--port", str(s.getsockname()[1])])) == 2
    assert "is in use" in capsys.readouterr().err


def test_serve_reports_missing_service(capsys) -> None:
    from shared.launcher import serve

    # A name that passes the parser but has no module (a service not written yet reads the same).
    class Args:
        service = "no_such_service"
        service_args: list[str] = []

    assert serve.run(Args()) == 2  # type: ignore[arg-type]
    assert "not available" in capsys.readouterr().err


def test_startup_timeout_names_what_is_not_up() -> None:
    async def scenario() -> str | None:
        sup = Supervisor(emit=lambda line: None, backoff=Backoff(initial=0.1, maximum=60))
        await sup.start(ProcessSpec("decode-0", (sys.executable, "-c", "raise SystemExit(3)")))
        try:
            return await wait_healthy(f"http://127.0.0.1:{free_port()}/health", 1.5, sup, asyncio.Event())
        finally:
            t0 = time.monotonic()
            await sup.stop(["decode-0"], timeout=30)  # it sits in a restart delay, which must not hold this up
            assert time.monotonic() - t0 < 2

    problem = asyncio.run(scenario())
    assert problem is not None
    assert "/health not healthy after 2s" in problem and "not answering" in problem
    assert re.search(r"decode-0: .*last (exit|with) code 3", problem), problem


def test_second_signal_kills_stragglers() -> None:
    async def scenario() -> dict[str, int | None]:
        sup = Supervisor(emit=lambda line: None)
        # Ignores SIGTERM, like a service stuck in its drain.
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
        await sup.start(ProcessSpec("stuck", (sys.executable, "-c", code)))
        await asyncio.sleep(0.5)
        hurry = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, hurry.set)
        t0 = time.monotonic()
        codes = await sup.stop(["stuck"], timeout=30, hurry=hurry)
        assert time.monotonic() - t0 < 5
        return codes

    assert asyncio.run(scenario()) == {"stuck": -signal.SIGKILL}


# ---------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from shared.models.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("launcher") / "demo")


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(workdir=tmp_path) as server:
        yield server


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OTEL_", "KVMESH_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


class Lines:
    """Collects a child's output lines in a thread; wait_for() blocks until a line matches."""

    def __init__(self, stream) -> None:  # noqa: ANN001
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:  # noqa: ANN001
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} in {timeout}s; output:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(left)


def test_serve_tokenizer_stops_cleanly(nats: NatsServer, demo_model: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "serve", "tokenizer", "--model", str(demo_model), "--nats-url", nats.url],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out = Lines(proc.stdout)
        out.wait_for(r"tokenizer serving on", timeout=60)
        # The container health check finds this host's replica over NATS; a missing service fails it.
        assert healthcheck.main(["tokenizer", "--nats-url", nats.url]) == 0
        assert healthcheck.main(["decode", "--nats-url", nats.url, "--timeout", "1"]) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        out.wait_for(r"tokenizer stopped", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_supervisor_restarts_a_dead_service(nats: NatsServer, demo_model: Path) -> None:
    (tokenizer,) = [s for s in mesh_services(MeshOptions(model=str(demo_model))) if s.service == "tokenizer"]
    (spec,) = tokenizer.processes(sys.executable, {"NATS_URL": nats.url})
    lines: list[str] = []

    async def wait_for(pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in lines[start:]:
                if m := re.search(pattern, line):
                    return m
            await asyncio.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(lines[-40:]))

    async def scenario() -> None:
        sup = Supervisor(emit=lines.append, backoff=Backoff(initial=0.2))
        child = await sup.start(spec)
        try:
            await wait_for(r"^\[tokenizer-0\] .*tokenizer serving on", 60)
            first = child.proc.pid  # type: ignore[union-attr]
            os.kill(first, signal.SIGKILL)
            mark = len(lines)
            await wait_for(r"^\[kvmesh\] tokenizer-0 exited with code -9 \(SIGKILL\); restarting in 0\.2s", 10, mark)
            again = await wait_for(r"^\[kvmesh\] started tokenizer-0 \(pid (\d+)\)", 10, mark)
            assert int(again[1]) != first
            await wait_for(r"^\[tokenizer-0\] .*tokenizer serving on", 60, mark)
            assert child.starts == 2
        finally:
            codes = await sup.stop([spec.name], timeout=20)
        assert codes == {"tokenizer-0": 0}
        assert not child.running

    asyncio.run(scenario())


GRACE_S = 10.0


def test_up_end_to_end(demo_model: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shared.cli", "up", "--model", str(demo_model), "--port", str(port),
         "--grace", str(GRACE_S), "--startup-timeout", "120", "--remote-prefill-threshold", "0",
         "--kvstore-disk-dir", str(tmp_path / "kvstore"), "--nats-tls", "--nats-servers", "3", "--nats-monitor"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        out = Lines(proc.stdout)
        base = out.wait_for(rf"{READY} (http://\S+)/v1", timeout=150)[1]
        pids = {m[1]: int(m[2]) for line in out.lines if (m := re.search(r"^\[kvmesh\] started (\S+) \(pid (\d+)\)", line))}
        assert {"nats-0", "nats-1", "nats-2", "kvstore-0", "tokenizer-0", "prefill-0", "decode-0",
                "gateway-0"} <= set(pids)
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200

        import openai

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
        assert completion.choices[0].finish_reason in ("stop", "length")
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        # Every path through the locked-down bus (remote prefill and its KV push, kvstore offload and
        # fetch, streaming, block events, beats) works with the per-role permissions.
        long_prompt = "The mesh moves KV blocks between workers. " * 12
        first = client.completions.create(model=model, prompt=long_prompt, max_tokens=6, temperature=0)
        again = client.completions.create(model=model, prompt=long_prompt, max_tokens=6, temperature=0)
        assert first.choices[0].text == again.choices[0].text
        # A NATS server of the cluster dies (SIGKILL): its clients move to the other two, and the
        # supervisor brings it back. The mesh goes on serving throughout.
        monitors = [m[1] for line in out.lines if (m := re.search(r"nats-\d at \S+ \(monitoring (\S+);", line))]
        connections = [httpx.get(f"{url}/connz", timeout=5).json()["num_connections"] for url in monitors]
        assert len(connections) == 3 and min(connections) >= 1, connections  # the services are spread
        mark = len(out.lines)
        os.kill(pids["nats-1"], signal.SIGKILL)
        time.sleep(0.5)
        after_kill = client.completions.create(model=model, prompt=long_prompt, max_tokens=6, temperature=0)
        assert after_kill.choices[0].text == first.choices[0].text
        pids["nats-1"] = int(out.wait_for(r"started nats-1 \(pid (\d+)\)", timeout=30, start=mark)[1])
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True)
            if c.choices)
        assert streamed
        assert "one user per process, subject permissions, TLS" in "\n".join(out.lines)
        assert (tmp_path / "kvstore").is_dir(), "the kvstore runs with its disk tier"
        assert not any("Violation" in line for line in out.lines), [l for l in out.lines if "Violation" in l]

        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=GRACE_S + 15) == 0, "\n".join(out.lines[-40:])
        assert time.monotonic() - t0 < GRACE_S, "\n".join(out.lines[-40:])
        for name, pid in pids.items():  # every child, nats-server included, is gone
            assert not _alive(pid), name
        assert not any("did not stop" in line or "killing it" in line for line in out.lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent, the launcher, has exited; init reaps it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_up_passes_the_gateway_parsers_only_when_asked() -> None:
    from shared.launcher.process_spec import MeshOptions, mesh_services

    def gateway_args(**kw) -> str:  # noqa: ANN003
        return " ".join(next(s.args for s in mesh_services(MeshOptions(**kw)) if s.service == "gateway"))

    assert "--tool-call-parser" not in gateway_args() and "--reasoning-parser" not in gateway_args()
    assert "--structured-outputs-in-reasoning" not in gateway_args()
    args = gateway_args(tool_call_parser="mistral", reasoning_parser="qwen3", structured_outputs_in_reasoning=True)
    assert "--tool-call-parser mistral" in args and "--reasoning-parser qwen3" in args
    assert "--structured-outputs-in-reasoning" in args
