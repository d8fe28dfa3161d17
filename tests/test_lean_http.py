"""The bench's lean HTTP/1.1 client (loadtest/lean_http.py) against a small real HTTP server on a real socket
that writes its responses byte for byte (chunk size lines, CRLFs and SSE events split across writes, chunk
extensions, trailers, Content-Length, Connection: close, a connection cut mid-chunk), and against the real
gateway of a simulated mesh: the documented tokens streamed, a 429 with Retry-After (tests/test_scale_bench.py)."""
from __future__ import annotations

import asyncio
import json

import pytest

from loadtest.lean_http import LeanConnection, LeanHTTPError
from loadtest.retry import advised_s


class RawServer:
    """Answers each request on a connection with the next scripted response: a list of byte strings written
    with a pause between them (so the client sees them in separate reads), then a hang-up where the list ends
    with None; or "CLOSE" to hang up without answering."""

    def __init__(self, responses: list) -> None:  # noqa: ANN001
        self.responses = list(responses)
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                parts = self.responses.pop(0)
                if parts == "CLOSE":
                    break
                for p in parts:
                    if p is None:
                        break
                    writer.write(p)
                    await writer.drain()
                    await asyncio.sleep(0.002)
                if parts[-1] is None or any(b"Connection: close" in p for p in parts):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def _sse(*payloads: str, crlf: bool = False) -> bytes:
    nl = "\r\n" if crlf else "\n"
    return "".join(f"data: {p}{nl}{nl}" for p in payloads).encode()


def _chunked(body: bytes, sizes: list[int]) -> list[bytes]:
    """body as chunks of these sizes, every chunk's size line with an extension, then a trailer."""
    out, i = [], 0
    for n in sizes:
        out.append(f"{n:x};ext=1\r\n".encode() + body[i:i + n] + b"\r\n")
        i += n
    assert i == len(body)
    return out + [b"0\r\nX-Trailer: t\r\n\r\n"]


def _split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_chunked_sse_split_anywhere_is_decoded_and_the_connection_kept() -> None:
    events = [json.dumps({"choices": [{"text": f"t{i}"}]}) for i in range(5)] + ['{"choices":[],"usage":{"x":1}}',
                                                                               "[DONE]"]
    body = _sse(*events)
    wire = b"".join(_chunked(body, [7, 1, len(body) - 20, 12]))
    # First response: every byte boundary hit (size lines, CRLFs, events split 3 bytes at a time).
    # Second: the same body with CRLF event lines, in one write. Third: Content-Length, plain JSON.
    body2 = _sse(*events, crlf=True)
    plain = b'{"ok":true}'
    server = RawServer([[HEAD_CHUNKED, *_split_every(wire, 3)],
                        [HEAD_CHUNKED + b"".join(_chunked(body2, [len(body2)]))],
                        [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(plain) + plain]])

    async def go() -> None:
        async with server as base:
            conn = LeanConnection(base)
            for _ in range(2):
                r = await conn.post_json("/v1/completions", {"prompt": [1, 2]})
                assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
                got = [d async for batch in r.sse_data() for d in batch]
                assert got == events
            r = await conn.request("GET", "/x")
            assert await r.json() == {"ok": True}
            assert server.connections == 1  # keep-alive: three requests, one connection
            assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
            assert server.requests[0].endswith(b'{"prompt":[1,2]}')
            conn.close()

    run(go())


def test_events_that_arrive_together_come_in_one_batch() -> None:
    body = _sse("a", "b", "c")
    server = RawServer([[HEAD_CHUNKED + b"".join(_chunked(body, [len(body)]))]])

    async def go() -> None:
        async with server as base:
            conn = LeanConnection(base)
            r = await conn.post_json("/", {})
            assert [b async for b in r.sse_data()] == [["a", "b", "c"]]
            conn.close()

    run(go())


def test_a_429_with_retry_after_and_connection_close_then_a_new_connection() -> None:
    err = b'{"error":{"message":"busy","code":"too_many_requests"}}'
    server = RawServer([[b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nretry-after-ms: 1500\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(err) + err],
                        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])

    async def go() -> None:
        async with server as base:
            conn = LeanConnection(base)
            r = await conn.post_json("/v1/completions", {})
            assert r.status == 429 and r.reason == "Too Many Requests"
            assert advised_s(r.headers) == 1.5  # retry-after-ms preferred, as loadtest/retry.py reads it
            assert (await r.json())["error"]["code"] == "too_many_requests"
            r = await conn.post_json("/v1/completions", {})
            assert await r.read() == b"ok"
            assert server.connections == 2
            conn.close()

    run(go())


def test_a_connection_cut_mid_chunk_is_an_error_and_a_stale_one_is_reopened() -> None:
    body = _sse("a", "b")
    server = RawServer([[HEAD_CHUNKED, b"%x\r\n" % len(body) + body[:5], None], "CLOSE",
                        [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]])

    async def go() -> None:
        async with server as base:
            conn = LeanConnection(base)
            r = await conn.post_json("/", {})
            with pytest.raises(LeanHTTPError, match="closed mid-response"):
                async for _ in r.sse_data():
                    pass
            # The server hangs up on the next request before answering it ("CLOSE"): that is an error too, on a
            # fresh connection (nothing to retry).
            with pytest.raises(LeanHTTPError, match="before the status line"):
                await (await conn.post_json("/", {})).read()
            r = await conn.post_json("/", {})
            assert await r.read() == b"ok"
            conn.close()

    run(go())


def test_garbage_is_an_error_and_https_is_refused() -> None:
    server = RawServer([[b"SSH-2.0-OpenSSH\r\n\r\n"], [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]])

    async def go() -> None:
        async with server as base:
            with pytest.raises(LeanHTTPError, match="not an HTTP/1.x status line"):
                await LeanConnection(base).post_json("/", {})
            r = await LeanConnection(base).post_json("/", {})
            with pytest.raises(LeanHTTPError, match="bad chunk size"):
                await r.read()

    run(go())
    with pytest.raises(ValueError, match="plain http"):
        LeanConnection("https://example.com")


def test_a_keep_alive_connection_the_server_closed_while_idle_is_reopened_and_the_request_sent_again() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server = RawServer([[ok, None], [ok]])  # the first connection ends after one answer, no Connection: close

    async def go() -> None:
        async with server as base:
            conn = LeanConnection(base)
            assert await (await conn.request("GET", "/a")).read() == b"ok"
            await asyncio.sleep(0.05)
            assert await (await conn.request("GET", "/b")).read() == b"ok"
            assert server.connections == 2 and server.requests[-1].startswith(b"GET /b ")
            conn.close()

    run(go())
