"""The gateway over real HTTP (official openai client), a real nats-server, the real tokenizer
service and engine-backed decode responders (tests/gateway_harness.py)."""
from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from shared import bus, subjects
from shared.protocol.events import LoadBeat
from tests.checkpoints import build_checkpoint
from tests.gateway_harness import Mesh, one_decoder_mesh

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("gw") / "llama").path


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, model_dir=model_dir) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=30)


def greedy(client: openai.OpenAI, **kw):  # noqa: ANN003, ANN201
    return client.completions.create(model="tiny", temperature=0, **kw)


# ------------------------------------------------------------------------------------------ basics


def test_models_lists_max_model_len(client) -> None:  # noqa: ANN001
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.model_extra["max_model_len"] == 512


def test_completion_and_usage(client) -> None:  # noqa: ANN001
    r = greedy(client, prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_deltas_concatenate_to_the_whole_text(client) -> None:  # noqa: ANN001
    kw = dict(prompt="The quick brown fox", max_tokens=24, extra_body={"ignore_eos": True})
    whole = greedy(client, **kw).choices[0].text
    chunks = list(greedy(client, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole and whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_matches_chat_whole(client) -> None:  # noqa: ANN001
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_completion_tokens=16,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16


def test_sse_wire_format_ends_with_usage_then_done(mesh) -> None:  # noqa: ANN001
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4 and usage["usage"]["prompt_tokens"] == 3


def test_n_choices_with_seed_and_logprobs(client) -> None:  # noqa: ANN001
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=3, seed=7, temperature=1.0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    for c in r.choices:
        assert len(c.logprobs.tokens) == 6 and len(c.logprobs.top_logprobs[0]) <= 2
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=3, seed=7, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + i per choice: reproducible
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3


def test_stop_string_spanning_two_tokens(client, mesh) -> None:  # noqa: ANN001
    kw = dict(prompt="In the beginning", max_tokens=40, logprobs=0, extra_body={"ignore_eos": True})
    full = greedy(client, **kw).choices[0]
    tokens = full.logprobs.tokens
    # A stop string made of the end of one token and the start of the next, past the first token.
    k = next(i for i in range(1, len(tokens) - 1)
             if tokens[i].strip() and tokens[i + 1].strip() and "\ufffd" not in tokens[i] + tokens[i + 1])
    offset = sum(len(t) for t in tokens[:k])
    stop = tokens[k][-1] + tokens[k + 1][0]
    cut = full.text.find(stop)
    assert 0 <= cut <= offset + len(tokens[k]) - 1
    before = mesh.decoders["d0"].num_cancels
    r = greedy(client, stop=[stop], **kw).choices[0]
    assert r.text == full.text[:cut] and r.finish_reason == "stop"
    streamed = list(greedy(client, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == full.text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"
    # reaching the stop string cancelled the rest of the generation in the worker
    mesh.wait_until(lambda: mesh.decoders["d0"].num_cancels >= before + 2 and mesh.held("d0") == 0)


# ------------------------------------------------------------------------------------------ errors


def expect_error(exc_type: type, fn, status: int, param: str | None = None) -> str:  # noqa: ANN001
    with pytest.raises(exc_type) as info:
        fn()
    err = info.value
    assert err.status_code == status
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if param is not None:
        assert body["param"] == param
    return body["message"]


def test_error_cases(client, mesh) -> None:  # noqa: ANN001
    d0 = mesh.decoders["d0"]
    received, cancelled = d0.num_received, d0.num_cancels
    expect_error(openai.NotFoundError, lambda: client.completions.create(model="gpt-4", prompt="x"), 404, "model")
    msg = expect_error(openai.BadRequestError, lambda: greedy(client, prompt=[5] * 500, max_tokens=100), 400, "max_tokens")
    assert "512" in msg and "600" in msg
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt="", max_tokens=3), 400, "prompt")
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt=[], max_tokens=3), 400)
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt=[1, 512], max_tokens=3), 400, "prompt")
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt=[1, -1], max_tokens=3), 400, "prompt")
    expect_error(openai.BadRequestError, lambda: client.completions.create(model="tiny", prompt="x", temperature=5), 400,
                 "temperature")
    expect_error(openai.BadRequestError, lambda: client.completions.create(model="tiny", prompt="x", n=9), 400, "n")
    expect_error(openai.BadRequestError, lambda: client.completions.create(model="tiny", prompt="x", logprobs=21), 400)
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(model="tiny", messages=[]), 400, "messages")
    expect_error(openai.BadRequestError, lambda: client.completions.create(model="tiny", prompt="x", max_tokens=0), 400)
    r = httpx.post(f"{mesh.url}/v1/completions", content=b'{"model": "tiny", "prompt": ', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{mesh.url}/v1/chat/completions", content=b"[1,2", timeout=10, headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # none of that reached a worker
    assert d0.num_received == received and d0.num_cancels == cancelled


def test_bad_requests_do_not_disturb_good_ones(client) -> None:  # noqa: ANN001
    prompts = [f"story number {i}" for i in range(6)]
    expected = [greedy(client, prompt=p, max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    def good(i: int) -> str:
        return greedy(client, prompt=prompts[i], max_tokens=10, extra_body={"ignore_eos": True}).choices[0].text

    def bad(i: int) -> int:
        try:
            greedy(client, prompt=[9999] if i % 2 else "x", max_tokens=10 if i % 2 else 1000)
        except openai.BadRequestError as e:
            return e.status_code
        return 200

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(6)]
        bads = [pool.submit(bad, i) for i in range(6)]
        assert [f.result() for f in goods] == expected
        assert [f.result() for f in bads] == [400] * 6


def test_disconnects_cancel_in_the_worker(mesh) -> None:  # noqa: ANN001
    d0 = mesh.decoders["d0"]
    before = d0.num_cancels
    body = {"model": "tiny", "prompt": "long", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    mesh.wait_until(lambda: d0.num_cancels > before and mesh.held("d0") == 0, timeout=2)
    before = d0.num_cancels
    # Not streamed: the client gives up waiting once the worker runs the request (a fixed client timeout raced the
    # C++ CPU path, which finishes 480 tokens of the tiny model in about as long).
    host, port = mesh.url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        mesh.wait_until(lambda: mesh.held("d0") > 0, timeout=5)
    mesh.wait_until(lambda: d0.num_cancels > before and mesh.held("d0") == 0, timeout=2)


def test_metrics_have_kvmesh_series(client, mesh) -> None:  # noqa: ANN001
    greedy(client, prompt="metrics please", max_tokens=4)
    text = httpx.get(f"{mesh.url}/metrics", timeout=10).text
    for name in ("kvmesh:request_success_total", "kvmesh:prompt_tokens_total", "kvmesh:generation_tokens_total",
                 "kvmesh:num_requests_running", "kvmesh:num_requests_waiting", "kvmesh:time_to_first_token_seconds_bucket",
                 "kvmesh:inter_token_latency_seconds_bucket", "kvmesh:e2e_request_latency_seconds_bucket",
                 "kvmesh:prefix_cache_hit_rate", "kvmesh:kv_cache_usage_perc"):
        assert name in text, name
    assert 'worker="d0"' in text and 'finished_reason="length"' in text


# ------------------------------------------------------------------- health, auth, no worker, overload


def test_health_auth_and_unavailable(model_dir, tmp_path) -> None:  # noqa: ANN001
    m = Mesh(tmp_path, model_dir, api_key=KEY, max_waiting=2, stream_idle_timeout_s=1.0)
    try:
        ok = openai.OpenAI(base_url=f"{m.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        r = httpx.get(f"{m.url}/health", timeout=10)  # open without a key
        assert r.status_code == 503 and r.json()["missing"] == ["tokenizer", "decode"]
        wrong = openai.OpenAI(base_url=f"{m.url}/v1", api_key=KEY + "x", max_retries=0, timeout=10)
        expect_error(openai.AuthenticationError, lambda: wrong.completions.create(model="tiny", prompt="x"), 401)
        expect_error(openai.AuthenticationError, lambda: wrong.models.list(), 401)
        r = httpx.post(f"{m.url}/v1/completions", json={"prompt": "x"}, timeout=10)  # no Authorization header
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

        m.start_tokenizer()
        r = httpx.get(f"{m.url}/health", timeout=10)
        assert r.status_code == 503 and r.json()["missing"] == ["decode"]
        with pytest.raises(openai.InternalServerError) as info:  # 503: no decode worker
            ok.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"]

        # a worker whose waiting queue is at the bound takes nothing new
        m.call(bus.publish(m.nc, subjects.decode_load("busy"), LoadBeat(
            worker_id="busy", running=8, waiting=5, free_blocks=0, total_blocks=10)))
        m.wait_until(lambda: m.gateway.ctx.router.alive())
        with pytest.raises(openai.InternalServerError) as info:
            ok.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.json()["error"]["code"] == "overloaded"
        assert "retry-after" in info.value.response.headers

        d = m.start_decoder("d1")
        m.wait_until(lambda: httpx.get(f"{m.url}/health", timeout=10).status_code == 200)
        assert d.num_received == 0 and d.num_cancels == 0  # the refused requests never reached it
        r = ok.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
        # the worker dies mid-stream: an error chunk, then [DONE], never a hang
        body = {"model": "tiny", "prompt": "x", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{m.url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = (line for line in r.iter_lines() if line)
            assert "choices" in json.loads(next(lines).removeprefix("data: "))
            m.crash("d1")
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        # the crashed worker sends no more beats: it expires, and health says so. It was the only worker, so the
        # gateway hears nobody and cannot tell its own lateness from the worker's death: it waits 3 expiry periods
        # (router.Router._silent), 6 s at the harness's 2 s.
        m.wait_until(lambda: httpx.get(f"{m.url}/health", timeout=10).status_code == 503, timeout=9)
    finally:
        m.close()


def test_gateway_span_carries_genai_attributes_and_one_trace(client) -> None:  # noqa: ANN001
    from shared.telemetry import attach_memory_exporter

    exporter = attach_memory_exporter()
    greedy(client, prompt="trace me", max_tokens=5, extra_body={"ignore_eos": True})
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "text_completion tiny"]
    a = root.attributes
    assert a["gen_ai.request.model"] == "tiny" and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.time_to_first_token"] > 0
    same_trace = {s.name for s in spans if s.context.trace_id == root.context.trace_id}
    # the tokenizer and decode requests (and their serving sides) joined the gateway's trace
    assert f"request {subjects.TOKENIZER_ENCODE}" in same_trace and f"serve {subjects.TOKENIZER_ENCODE}" in same_trace
    assert any(n.startswith("request kvmesh.decode.generate") for n in same_trace)
    assert any(n.startswith("serve kvmesh.decode.generate") for n in same_trace)
