"""nats-server's monitoring pages (/connz, /subsz: every connection's subscriptions, reply inboxes
included) have no authentication: any local user could read them. The nats-server `kvmesh up` starts,
from its real config, must listen on its client port only, unless --nats-monitor asks for the pages."""
from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request

from shared.launcher.local_nats import LocalNats, identity_passwords
from tests.test_security_mesh_tp import _listening


def _ports(pid: int) -> set[int]:
    return {int(addr.split(":")[1], 16) for addr in _listening(pid)}


def test_the_monitoring_pages_are_off_unless_asked_for(tmp_path) -> None:  # noqa: ANN001
    for monitor in (False, True):
        srv = LocalNats.on_free_ports(passwords=identity_passwords(["gateway-0", "decode-0"]),
                                      config_dir=tmp_path, monitor=monitor)
        proc = subprocess.Popen(list(srv.process().argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert asyncio.run(srv.wait_ready(15))
            if not monitor:
                assert _ports(proc.pid) == {srv.port}, "nats-server listens on more than its client port"
                assert "http" not in json.loads(srv.write_config().read_text()) and srv.monitor_url == ""
            else:  # asked for: served, on the loopback address only
                assert _ports(proc.pid) == {srv.port, srv.http_port}
                with urllib.request.urlopen(f"{srv.monitor_url}/varz", timeout=5) as r:
                    assert json.load(r)["host"] == "127.0.0.1"
        finally:
            proc.terminate()
            proc.wait(5)
