"""Count the chunks of one streamed forced tool call (issue 26's figure) against a running OpenAI-compatible server.

Usage: python -m loadtest.tool_call_chunks BASE_URL MODEL OUT.json   (BASE_URL ends in /v1)
Per request (required / named tool_choice, max_tokens 60 and 8): chunks, empty chunks (no content, tool-call
delta, finish reason or role), chunks with a tool-call delta, completion tokens, finish reason."""
import json, sys
import openai

url, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
res = {}
for choice, tc in (("required", "required"), ("named", {"type": "function", "function": {"name": "get_weather"}})):
    for max_tokens in (60, 8):
        chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is the weather like in Tokyo today?"}],
                                                tools=[TOOL], tool_choice=tc, max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        body = [ch for ch in chunks if ch.choices]
        empty = sum(1 for ch in body if not (ch.choices[0].delta.content or ch.choices[0].delta.tool_calls
                                            or ch.choices[0].finish_reason or ch.choices[0].delta.role))
        with_calls = sum(1 for ch in body if ch.choices[0].delta.tool_calls)
        usage = next((ch.usage for ch in chunks if ch.usage), None)
        res[f"{choice}_max{max_tokens}"] = {"chunks": len(body), "empty_chunks": empty, "chunks_with_tool_call_delta": with_calls,
                                           "completion_tokens": usage.completion_tokens if usage else None,
                                           "finish_reason": body[-1].choices[0].finish_reason}
json.dump(res, open(out, "w"), indent=1); print(json.dumps(res, indent=1))
