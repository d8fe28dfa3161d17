"""Count the chunks of one streamed forced tool call (issue 26's figure) against a running OpenAI-compatible server.

Usage: python -m loadtest.experiments.streaming_text.tool_call_chunks BASE_URL MODEL OUT.json   (BASE_URL ends in /v1)
Per request (required / named tool_choice, max_tokens 60 and 8): chunks, empty chunks (no content, tool-call
delta, finish reason or role), chunks with a tool-call delta, completion tokens, finish reason.
"""
from __future__ import annotations

import json
import sys

import openai

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


def count(client: openai.OpenAI, model: str, tool_choice, max_tokens: int) -> dict:  # noqa: ANN001 - str or dict
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather like in Tokyo today?"}], tools=[TOOL],
        tool_choice=tool_choice, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}))
    body = [c for c in chunks if c.choices]
    empty = sum(1 for c in body if not (c.choices[0].delta.content or c.choices[0].delta.tool_calls
                                        or c.choices[0].finish_reason or c.choices[0].delta.role))
    usage = next((c.usage for c in chunks if c.usage), None)
    return {"chunks": len(body), "empty_chunks": empty,
            "chunks_with_tool_call_delta": sum(1 for c in body if c.choices[0].delta.tool_calls),
            "completion_tokens": usage.completion_tokens if usage else None,
            "finish_reason": body[-1].choices[0].finish_reason}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    url, model, out = argv
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    res = {f"{name}_max{n}": count(client, model, choice, n) for name, choice in CHOICES.items() for n in (60, 8)}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
