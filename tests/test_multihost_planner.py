"""The planner on the first host scales decode workers on another host (network namespaces): it asks the joined
host's launcher over the bus (`kvmesh.hosts.<host>.scale`, its own bus users on both ends), which starts or
drains them; the gateway routes to the new worker and forgets the drained one. Simulated engine workers (the
real scheduler and bus protocol, no model) keep it quick."""
from __future__ import annotations

import asyncio

import nats
import pytest

from shared.bus.roles import inbox_prefix
from shared.launcher import mesh_secret
from shared.launcher.join_file import JoinFile
from shared.planner.remote_scaler import PLANNER_USER, RemoteHostScaler
from tests.checkpoints import build_checkpoint
from tests.netns_hosts import NetnsHosts, available
from tests.netns_mesh import MultiHostMesh

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=f"no network namespaces: {available()}")]


def test_multihost_planner_scales_decode_on_a_joined_host(tmp_path) -> None:
    model = build_checkpoint("llama", tmp_path / "llama").path
    with NetnsHosts(2) as hosts:
        m = MultiHostMesh(hosts, model, tmp_path)
        try:
            m.start_first("a", "--engine", "sim", "--planner", "load", "--planner-host", "b", "--decode-min", "1",
                          "--decode-max", "2", "--planner-interval", "600")
            m.join("b", 1, 0, "--engine", "sim", "--decode-max", "2")
            m.wait_ready({"decode-b_0"})
            join = JoinFile.read(m.join_file)
            a = hosts["a"]

            async def planner_asks(n: int) -> int:
                nc = await nats.connect(f"nats://{a.address}:{_client_port(m)}", user=PLANNER_USER,
                                        password=mesh_secret.process_password(join.secret, PLANNER_USER),
                                        inbox_prefix=inbox_prefix(PLANNER_USER))
                try:
                    scaler = RemoteHostScaler(nc, "b", {})
                    await scaler.scale("decode", n)
                    return scaler.count("decode")
                finally:
                    await nc.close()

            assert asyncio.run(planner_asks(2)) == 2
            m.wait_decode_workers(lambda alive: {"decode-b_0", "decode-b_1"} <= alive, timeout=90)
            assert asyncio.run(planner_asks(1)) == 1  # answered once decode-b_1 has drained and exited
            m.wait_decode_workers(lambda alive: alive == {"decode-b_0"}, timeout=60)
            assert "planner (load)" in m.launchers["a"][1].text()
        except BaseException:
            print(m.output())
            raise


def _client_port(m: MultiHostMesh) -> int:
    import re

    text = m.launchers["a"][1].text()
    return int(re.search(r"nats at nats://[\d.]+:(\d+)", text)[1])
