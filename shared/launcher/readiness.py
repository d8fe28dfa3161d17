"""Waiting for the gateway's /health, and saying what is not up when it never gets there."""
from __future__ import annotations

import asyncio

import httpx

from shared.launcher.supervisor import Supervisor


async def wait_healthy(health_url: str, timeout: float, supervisor: Supervisor, stop: asyncio.Event) -> str | None:
    """None once `health_url` answers 200; otherwise (timeout) a message naming what is not up.

    Returns None early too when `stop` is set; the caller checks `stop` itself.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = "no answer yet"
    async with httpx.AsyncClient(timeout=2.0) as client:
        while loop.time() < deadline and not stop.is_set():
            try:
                r = await client.get(health_url)
                if r.status_code == 200:
                    return None
                last = f"HTTP {r.status_code}: {r.text.strip()[:500]}"  # the gateway names what is missing
            except httpx.HTTPError as e:
                last = f"not answering ({type(e).__name__})"
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
    if stop.is_set():
        return None
    down = [c.status() for c in supervisor.children.values() if not c.running or c.last_exit is not None]
    msg = f"{health_url} not healthy after {timeout:.0f}s; last answer: {last}"
    if down:
        msg += "; in trouble: " + "; ".join(down)
    return msg
