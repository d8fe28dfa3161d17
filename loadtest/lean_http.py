"""A lean streaming HTTP/1.1 client for the load generators: one keep-alive connection per stream loop, a JSON
POST, the response's status and headers, and its body as SSE `data:` payloads (chunked or Content-Length).

Why not httpx: at 2,000 concurrent streams the bench's own httpx client was the busiest process on the machine
(~1.15 ms of CPU per streamed token on a quiet 2-core machine), so its lag was counted as time the
mesh adds. This does the least the benchmark needs: one `read()` per socket read (however many chunks and events
it holds), chunked decoding and SSE splitting on bytes with `find`, no per-line coroutine, no pool, no
per-request objects beyond the response. It speaks plain http:// only, one request at a time per connection,
and reconnects when the server closes (Connection: close, EOF between requests). Where the API's correctness
matters (the tests, `bench serve`'s default client), the real httpx/openai clients stay.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

READ_SIZE = 1 << 16


class LeanHTTPError(ConnectionError):
    """The server broke the protocol or the connection mid-response."""


@dataclass
class LeanResponse:
    status: int
    reason: str
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value
    _conn: LeanConnection = field(repr=False)
    _chunked: bool = False
    _remaining: int | None = None  # Content-Length left to read (None: chunked, or until EOF)
    _chunk_left: int = 0  # bytes of the current chunk still to come (chunked)
    _crlf: bool = False  # the CRLF that ends a chunk's data is still to come (chunked)
    _done: bool = False

    async def read(self) -> bytes:
        """The whole (rest of the) body."""
        out = bytearray()
        async for piece in self._body():
            out += piece
        return bytes(out)

    async def json(self) -> object:
        return json.loads(await self.read())

    async def sse_data(self) -> AsyncIterator[list[str]]:
        """The `data:` payloads of the SSE events, in batches: every event complete in what one socket read brought
        (one timestamp serves them all). Comments, `event:`/`id:` lines and the `[DONE]` marker are passed
        through as they are, i.e. `[DONE]` is a payload like any other."""
        pending = b""
        async for piece in self._body():
            pending += piece
            if b"\r" in pending:  # CRLF line ends (the spec allows CR, LF or CRLF; kvmesh sends LF)
                pending = pending.replace(b"\r\n", b"\n")
            end = pending.rfind(b"\n\n")
            if end < 0:
                continue
            events, pending = pending[:end], pending[end + 2:]
            batch = []
            for event in events.split(b"\n\n"):
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        batch.append(line[5:].strip().decode())
            if batch:
                yield batch

    async def _body(self) -> AsyncIterator[bytes]:
        c = self._conn
        try:
            while not self._done:
                if self._chunked:
                    piece = await self._chunked_piece()
                else:
                    piece = await self._plain_piece()
                if piece:
                    yield piece
        finally:
            if not self._done:
                c.close()  # abandoned mid-body: the connection is not reusable

    async def _plain_piece(self) -> bytes:
        c = self._conn
        if self._remaining == 0:
            self._finish()
            return b""
        if not c.buf:
            data = await c.reader.read(READ_SIZE)
            if not data:
                if self._remaining is None:  # delimited by EOF
                    c.keep = False
                    self._finish()
                    return b""
                raise LeanHTTPError(f"connection closed with {self._remaining} body bytes to come")
            c.buf += data
        take = len(c.buf) if self._remaining is None else min(self._remaining, len(c.buf))
        piece = bytes(c.buf[:take])
        del c.buf[:take]
        if self._remaining is not None:
            self._remaining -= take
            if self._remaining == 0:
                self._finish()
        return piece

    async def _chunked_piece(self) -> bytes:
        """Everything decodable from the buffer (several chunks at once), reading the socket only when nothing is."""
        c = self._conn
        out = bytearray()
        while True:
            buf = c.buf
            if self._chunk_left:
                take = min(self._chunk_left, len(buf))
                out += buf[:take]
                del buf[:take]
                self._chunk_left -= take
                if self._chunk_left:
                    if out:
                        return bytes(out)
                    await c.fill()
                    continue
                self._crlf = True
            if self._crlf:  # the CRLF after a chunk's data
                if len(buf) < 2:
                    if out:
                        return bytes(out)
                    await c.fill()
                    continue
                if buf[:2] != b"\r\n":
                    raise LeanHTTPError("chunk data not followed by CRLF")
                del buf[:2]
                self._crlf = False
            nl = buf.find(b"\r\n")
            if nl < 0:
                if out:
                    return bytes(out)
                if len(buf) > 1024:
                    raise LeanHTTPError("chunk size line too long")
                await c.fill()
                continue
            size_text = bytes(buf[:nl]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise LeanHTTPError(f"bad chunk size {size_text[:20]!r}") from None
            if size < 0:
                raise LeanHTTPError(f"bad chunk size {size_text[:20]!r}")
            if size == 0:
                end = buf.find(b"\r\n\r\n", nl)  # the last chunk: trailers (if any) up to the empty line
                if end < 0:
                    if out:
                        return bytes(out)
                    await c.fill()
                    continue
                del buf[:end + 4]
                self._finish()
                return bytes(out)
            del buf[:nl + 2]
            self._chunk_left = size

    def _finish(self) -> None:
        self._done = True
        if not self._conn.keep:
            self._conn.close()


class LeanConnection:
    """One HTTP/1.1 connection to `base` (http://host:port), opened on first use and again after the server
    closed it. Not for concurrent requests: one stream loop owns one connection."""

    def __init__(self, base: str, timeout_s: float = 300.0) -> None:
        u = urlsplit(base)
        if u.scheme != "http":
            raise ValueError(f"lean_http speaks plain http only, not {base!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self._host_header = u.netloc
        self.timeout_s = timeout_s
        self.reader: asyncio.StreamReader | None = None  # type: ignore[assignment]
        self.writer: asyncio.StreamWriter | None = None
        self.buf = bytearray()
        self.keep = True
        self._current: LeanResponse | None = None

    async def fill(self) -> None:
        data = await self.reader.read(READ_SIZE)  # type: ignore[union-attr]
        if not data:
            raise LeanHTTPError("connection closed mid-response")
        self.buf += data

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> LeanResponse:
        """Sends the request and reads the status line and headers. A connection the server closed while idle
        (keep-alive timeout) is reopened once and the request sent again: nothing of it reached the server."""
        if self._current is not None and not self._current._done:
            self.close()  # the last response was not read to its end: what is left of it is on the wire
        for attempt in (0, 1):
            fresh = self.writer is None
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
                self.buf.clear()
                self.keep = True
            head = [f"{method} {path} HTTP/1.1", f"Host: {self._host_header}", f"Content-Length: {len(body)}"]
            head += [f"{k}: {v}" for k, v in (headers or {}).items()]
            self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)  # type: ignore[union-attr]
            try:
                self._current = await asyncio.wait_for(self._head(), self.timeout_s)
                return self._current
            except BaseException as e:
                self.close()
                stale = isinstance(e, (ConnectionResetError, BrokenPipeError)) or "before the status line" in str(e)
                if fresh or attempt or not stale:
                    raise
        raise AssertionError("unreachable")

    async def post_json(self, path: str, payload: object, headers: Mapping[str, str] | None = None) -> LeanResponse:
        return await self.request("POST", path, json.dumps(payload, separators=(",", ":")).encode(),
                                  {"Content-Type": "application/json", **(headers or {})})

    async def _head(self) -> LeanResponse:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            data = await self.reader.read(READ_SIZE)  # type: ignore[union-attr]
            if not data:
                raise LeanHTTPError("connection closed before the status line" if not self.buf else
                                    "connection closed in the response head")
            self.buf += data
            if len(self.buf) > 1 << 20:
                raise LeanHTTPError("response head over 1 MiB")
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[:end + 4]
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise LeanHTTPError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        r = LeanResponse(int(code), reason, headers, self)
        self.keep = version != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            r._chunked = True
        elif "content-length" in headers:
            r._remaining = int(headers["content-length"])
        elif r.status in (204, 304) or 100 <= r.status < 200:
            r._remaining = 0
        else:
            r._remaining = None  # until the server closes
            self.keep = False
        return r

    def close(self) -> None:
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
        self.writer = self.reader = None
        self.buf.clear()


class _Stream:
    """What `bench serve`'s reader uses of an httpx streaming response (loadtest/serve/client.py)."""

    def __init__(self, resp: LeanResponse) -> None:
        self._resp = resp
        self.status_code = resp.status
        self.headers = resp.headers
        self._body = b""

    async def aread(self) -> bytes:
        self._body = await self._resp.read()
        return self._body

    def json(self) -> object:
        return json.loads(self._body)

    async def aiter_lines(self) -> AsyncIterator[str]:
        pending = b""
        async for piece in self._resp._body():
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.rstrip(b"\r").decode()


class LeanClient:
    """A pool of lean connections with the one call `bench serve` makes of httpx (`stream(...)` as an async context
    manager), for plain http:// targets: an idle connection is reused, a busy one never shared."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[str, list[LeanConnection]] = {}

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str, json: object = None,  # noqa: A002 - httpx's name
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[_Stream]:
        u = urlsplit(url)
        base = f"{u.scheme}://{u.netloc}"
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        idle = self._idle.setdefault(base, [])
        conn = idle.pop() if idle else LeanConnection(base, self.timeout_s)
        body = b"" if json is None else _json_bytes(json)
        hdrs = {**({"Content-Type": "application/json"} if json is not None else {}), **(headers or {})}
        resp = await conn.request(method, path, body, hdrs)
        try:
            yield _Stream(resp)
        except BaseException:
            conn.close()
            raise
        if not resp._done:
            # The reader stopped at `data: [DONE]`; the chunked body's end is usually in the same read.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(resp.read(), 1.0)
        if resp._done and conn.writer is not None:
            idle.append(conn)  # read to its end on a connection kept open: reusable
        else:
            conn.close()

    async def __aenter__(self) -> LeanClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()


def _json_bytes(payload: object) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()
