"""One client request of a fault test (chat or completions, streamed or not, maybe cancelled by its
client), classified: complete, a clean error (an OpenAI error with a code), cancelled, or lost."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

BOUND_S = 45.0  # no request may take longer than this, faults included


@dataclass
class Outcome:
    kind: str  # "complete" | "clean_error" | "cancelled" | "lost"
    seconds: float
    detail: str = ""


def one_request(base: str, rng: random.Random, i: int) -> Outcome:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    cancel_after = rng.uniform(0.05, 1.0) if rng.random() < 0.2 else None
    max_tokens = rng.randint(8, 48)
    prompt = f"request {i}: " + "lorem ipsum " * rng.randint(1, 40)
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if chat:
        url, body["messages"] = f"{base}/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, body["prompt"] = f"{base}/v1/completions", prompt
    t0 = time.monotonic()
    timeout = httpx.Timeout(BOUND_S if cancel_after is None else cancel_after)
    try:
        if not stream:
            r = httpx.post(url, json=body, timeout=timeout)
            if r.status_code != 200:
                err = r.json().get("error", {})
                return Outcome("clean_error" if err.get("code") else "lost", time.monotonic() - t0, str(err))
            usage = r.json()["usage"]
            ok = usage["completion_tokens"] == max_tokens
            return Outcome("complete" if ok else "lost", time.monotonic() - t0, f"{usage}")
        tokens_text, reason, error = "", None, None
        with httpx.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                err = r.json().get("error", {})
                return Outcome("clean_error" if err.get("code") else "lost", time.monotonic() - t0, str(err))
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                for c in chunk.get("choices", []):
                    reason = c.get("finish_reason") or reason
        if error is not None:
            return Outcome("clean_error" if error.get("code") else "lost", time.monotonic() - t0, str(error))
        return Outcome("complete" if reason == "length" else "lost", time.monotonic() - t0, f"reason {reason}")
    except httpx.TimeoutException:
        if cancel_after is not None:
            return Outcome("cancelled", time.monotonic() - t0)
        return Outcome("lost", time.monotonic() - t0, "no answer within the bound")
