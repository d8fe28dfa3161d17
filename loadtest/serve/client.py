"""One timed request to an OpenAI-compatible server (SSE or plain JSON)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from loadtest.retry import advised_s

from .datasets import Prompt
from .payload import Endpoint, Message, build_body


@dataclass
class RequestResult:
    """Raw timings of one request; times in seconds, relative to the run's start."""

    job: int
    turn: int
    requested_output_tokens: int
    prompt_len_estimate: int
    start: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft: float | None = None  # first chunk carrying text; equals e2e when not streaming
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between text-carrying chunks
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "none"  # "usage", "stream" (text chunks) or "words" (last resort)
    usage: dict | None = None  # exactly what the server reported, for auditing the counts
    stream_chunks: int = 0
    retry_after_s: float | None = None  # refused (429/503): the server's Retry-After (loadtest/retry.py)
    retries: int = 0  # refused attempts before this one (--retries)
    retry_wait_s: float = 0.0  # time waited between them (not in ttft/e2e, which time this attempt)
    finish_reason: str | None = None
    text: str = ""

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len_estimate

    def to_json(self, keep_text: bool = False) -> dict:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        d["input_tokens"] = self.input_tokens
        return d


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or choice.get("message") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def _apply_usage(r: RequestResult, usage: dict | None) -> None:
    if usage and usage.get("completion_tokens") is not None:
        r.usage = usage
        r.output_tokens = int(usage["completion_tokens"])
        r.output_tokens_source = "usage"
        if usage.get("prompt_tokens") is not None:
            r.prompt_tokens = int(usage["prompt_tokens"])


async def _read_stream(resp: httpx.Response, r: RequestResult, t0: float) -> None:
    last = t0
    pieces: list[str] = []
    async for line in resp.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        msg = json.loads(data)
        if msg.get("error"):
            raise RuntimeError(f"error in stream: {msg['error']}")
        if msg.get("usage"):
            _apply_usage(r, msg["usage"])
        for choice in msg.get("choices") or []:
            if choice.get("finish_reason"):
                r.finish_reason = choice["finish_reason"]
            text = _chunk_text(choice)
            if not text:
                continue
            r.stream_chunks += 1
            pieces.append(text)
            if r.ttft is None:
                r.ttft = now - t0
            else:
                r.itl.append(now - last)
            last = now
    r.text = "".join(pieces)
    if r.output_tokens_source != "usage":
        r.output_tokens, r.output_tokens_source = r.stream_chunks, "stream"


async def _read_json(resp: httpx.Response, r: RequestResult) -> None:
    msg = resp.json()
    choice = (msg.get("choices") or [{}])[0]
    r.text = _chunk_text(choice)
    r.finish_reason = choice.get("finish_reason")
    _apply_usage(r, msg.get("usage"))
    if r.output_tokens_source != "usage":
        r.output_tokens, r.output_tokens_source = len(r.text.split()), "words"


async def send(
    client: httpx.AsyncClient, ep: Endpoint, prompt: Prompt, history: list[Message], r: RequestResult, origin: float
) -> RequestResult:
    """Fill r in place. Never raises except CancelledError: every failure becomes r.error."""
    body = build_body(ep, prompt, history, r.requested_output_tokens)
    models = ep.model.split(",")
    if len(models) > 1:  # --model a,b,c: requests take the names in turn (LoRA adapters of one base, say)
        body["model"] = models[r.job % len(models)]
    t0 = time.perf_counter()
    r.start = t0 - origin
    try:
        async with client.stream("POST", ep.url, json=body, headers=ep.headers()) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                if resp.status_code in (429, 503):
                    r.retry_after_s = advised_s(resp.headers)
                raw = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {raw[:300]}")
            if ep.stream:
                await _read_stream(resp, r, t0)
            else:
                await resp.aread()
                await _read_json(resp, r)
        r.e2e = time.perf_counter() - t0
        if r.ttft is None:
            # Non-streaming has no first token to see; a stream with no text never produced one.
            r.ttft = r.e2e if not ep.stream else None
        r.ok = r.ttft is not None
        if not r.ok:
            r.error = "stream ended without any output text"
    except asyncio.CancelledError:
        r.ok, r.error = False, "cancelled: time limit reached"
        raise
    except Exception as e:  # noqa: BLE001 - any failure of one request is data, not a crash
        r.ok = False
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return r
