"""Joining a mesh from another host, without namespaces: the join file, the credentials derived from the mesh
secret, the flags' errors, and real nats-servers that route to each other only with the mesh's route password."""
from __future__ import annotations

import argparse
import json
import stat
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from shared.bus.roles import Identity
from shared.kv_transport.direct import same_host
from shared.launcher import mesh_secret, up
from shared.launcher.join import host_tag, joined_services
from shared.launcher.join_file import JoinFile, JoinFileError
from shared.launcher.local_nats import LocalNats
from shared.launcher.process_spec import MeshOptions
from shared.launcher.supervisor import Supervisor

SECRET = "ab" * 32


def test_multihost_join_file_round_trip_and_errors(tmp_path: Path) -> None:
    jf = JoinFile(SECRET, ("nats-route://10.0.0.1:6222",), served_model_name="m", prefill=2)
    path = jf.write(tmp_path / "mesh.join")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert JoinFile.read(path) == jf
    bad = {"not json": "{", "other kind": json.dumps({"kind": "x"}),
           "credentials in a route": json.dumps({"kind": "kvmesh-join", "version": 1, "secret": SECRET,
                                                  "routes": ["nats-route://route:pw@10.0.0.1:6222"]}),
           "short secret": json.dumps({"kind": "kvmesh-join", "version": 1, "secret": "ab",
                                        "routes": ["nats-route://10.0.0.1:6222"]}),
           "newer version": json.dumps({"kind": "kvmesh-join", "version": 9})}
    for why, text in bad.items():
        (tmp_path / "bad").write_text(text)
        with pytest.raises(JoinFileError):
            JoinFile.read(tmp_path / "bad")
    with pytest.raises(JoinFileError, match="cannot read"):
        JoinFile.read(tmp_path / "missing")


def test_multihost_credentials_are_per_process_and_derived() -> None:
    a = mesh_secret.process_password(SECRET, "decode-c_0")
    assert a == mesh_secret.process_password(SECRET, "decode-c_0")  # every host derives the same
    assert a != mesh_secret.process_password(SECRET, "decode-d_0")
    assert a != mesh_secret.process_password("cd" * 32, "decode-c_0")
    assert mesh_secret.route_password(SECRET) not in (a, mesh_secret.cache_salt(SECRET))
    assert len(mesh_secret.cache_salt(SECRET)) == 32


def test_multihost_joined_workers_are_named_by_host(tmp_path: Path) -> None:
    jf = JoinFile(SECRET, ("nats-route://10.0.0.1:6222",), kvstore=False, prefill=1, served_model_name="m")
    procs = joined_services(MeshOptions(model=str(tmp_path), decode=1, remote_workers=True), jf, 1, 2,
                            host_tag("gpu-box"))
    assert [p.name for p in procs] == ["prefill-gpu_box_0", "decode-gpu_box_0", "decode-gpu_box_1"]
    ident = Identity.of("decode-gpu_box_1")
    assert (ident.role, ident.worker_id) == ("decode", "decode-gpu_box_1")
    argv = " ".join(procs[1].argv)
    assert "--worker-id decode-gpu_box_0" in argv and "--no-kvstore" in argv and "--served-model-name m" in argv


def test_multihost_shared_memory_only_with_this_hosts_addresses() -> None:
    assert same_host("127.0.0.1")
    assert not same_host("192.0.2.7")  # TEST-NET-1: never an address of this machine


def _args(**kw) -> argparse.Namespace:  # noqa: ANN003
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args([a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", v)])


def test_multihost_flag_errors(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert up.run(_args(write_join=str(tmp_path / "j"), model=str(tmp_path))) == 2
    assert "--advertise-host" in capsys.readouterr().err
    assert up.run(_args(join=str(tmp_path / "missing"), model=str(tmp_path))) == 2
    assert "cannot read the join file" in capsys.readouterr().err


def _routes(server: LocalNats) -> int:
    with urllib.request.urlopen(f"{server.monitor_url}/routez", timeout=2) as r:
        return len({route["remote_id"] for route in json.load(r).get("routes") or []})  # peers, not pooled links


def test_multihost_only_the_mesh_route_password_joins_the_cluster(tmp_path: Path) -> None:
    """A nats-server whose route password was derived from another secret is refused by the mesh's server;
    one derived from the mesh's secret is routed in."""
    import asyncio

    first = LocalNats.cluster(1, config_dir=tmp_path, monitor=True, route_password=mesh_secret.route_password(SECRET))[0]
    stranger = LocalNats.cluster(1, config_dir=tmp_path, monitor=True, route_password=mesh_secret.route_password("cd" * 32),
                                 seed_routes=(first.route_url,))[0]
    member = LocalNats.cluster(1, config_dir=tmp_path, monitor=True, route_password=mesh_secret.route_password(SECRET),
                               seed_routes=(first.route_url,))[0]
    servers = [replace(s, name=f"nats-{i}") for i, s in enumerate((first, stranger, member))]  # one config each

    async def scenario() -> tuple[int, int]:
        sup = Supervisor(lambda line: None)
        try:
            for s in servers:
                await sup.start(s.process())
            for s in servers:
                assert await s.wait_ready(10)
            deadline = time.monotonic() + 10
            while _routes(servers[2]) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the stranger has had as long as the member to get in
            return _routes(servers[1]), _routes(servers[2])
        finally:
            await sup.stop([s.name for s in servers], timeout=5)

    assert asyncio.run(scenario()) == (0, 1)
