"""The planner's HTTP endpoint: GET /metrics (Prometheus text) and GET /decisions (the recent decisions as
JSON, newest last). A few lines of asyncio rather than a web framework: two read-only routes."""
from __future__ import annotations

import asyncio
import json

from prometheus_client import generate_latest

from shared.planner.planner import Planner

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PlannerEndpoint:
    def __init__(self, planner: Planner, host: str = "127.0.0.1", port: int = 0) -> None:
        self.planner = planner
        self.host, self.port = host, port
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here needs them
            parts = line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
            if method != "GET":
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE, generate_latest(self.planner.metrics.registry)
            elif path == "/decisions":
                status, ctype = "200 OK", "application/json"
                body = json.dumps({"mode": self.planner.config.mode, "counts": self.planner.counts(),
                                   "decisions": self.planner.decisions_json()}).encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"routes: /metrics, /decisions\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
