"""One HTTP request must not stall the gateway, the tokenizer or an engine: each class of costly request, sent
to a real mesh (nats-server, tokenizer service, decode worker, gateway) as an attacker would send it, while
another user streams and /health is polled. Each attack gets a clear 400 naming what was too big, or a normal
answer, and leaves /health answering within 5 s and the other user's stream without a gap over 2 s.

The bounds are generous on purpose (a shared 2-core machine): an attack that works stalls for far longer.
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from services.gateway.overload import REQUEST_COST_CONTEXTS
from services.gateway.sampling import MAX_LOGIT_BIAS, MAX_STOP_REGEX_CHARS
from services.tokenizer.template_sandbox import SandboxLimits
from shared import bus, subjects
from shared.protocol.tokenizer import ChatMessage, EncodeReply, EncodeRequest
from shared.sampling_params import MAX_SCHEMA_DEPTH, MAX_STRUCTURED_SPEC_CHARS
from tests.gateway_harness import one_decoder_mesh

WRITE_TIMEOUT_S = 2.0
HEALTH_BOUND_S = 5.0
GAP_BOUND_S = 2.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, "sechttp", stream_write_timeout_s=WRITE_TIMEOUT_S) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=60)


class Watch:
    """While an attack runs: another user streams answers one after another (the longest gap between two of a
    stream's chunks), and /health is polled (the slowest answer)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_gap = 0.0
        self.worst_health = 0.0
        self.chunks = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True),
                         threading.Thread(target=self._health, daemon=True)]

    def _stream(self) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60)
        while not self._stop.is_set():
            try:
                last = None
                stream = client.completions.create(model="tiny", prompt="another user's story", max_tokens=40,
                                                   stream=True, extra_body={"ignore_eos": True})
                for _ in stream:
                    now = time.monotonic()
                    if last is not None:
                        self.worst_gap = max(self.worst_gap, now - last)
                    last = now
                    self.chunks += 1
                    if self._stop.is_set():
                        stream.close()
                        break
            except Exception as e:  # noqa: BLE001 - reported by the assertion
                self.errors.append(repr(e))
                return

    def _health(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                httpx.get(f"{self.url}/health", timeout=30)
            except httpx.HTTPError as e:
                self.errors.append(repr(e))
            self.worst_health = max(self.worst_health, time.monotonic() - t0)
            time.sleep(0.1)

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + 30
        while self.chunks < 2 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.02)  # the other user's stream is flowing before the attack
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self._stop.set()
        for t in self._threads:
            t.join(60)
        if exc[0] is None:
            assert not self.errors, self.errors
            assert self.worst_health < HEALTH_BOUND_S, f"/health took {self.worst_health:.1f} s during the attack"
            assert self.worst_gap < GAP_BOUND_S, f"another user's stream stalled {self.worst_gap:.1f} s"


@contextlib.contextmanager
def watched(mesh) -> Iterator[Watch]:  # noqa: ANN001
    with Watch(mesh.url) as w:
        yield w


def post(mesh, path: str, body: dict, timeout: float = 60, **kw) -> httpx.Response:  # noqa: ANN001
    return httpx.post(f"{mesh.url}{path}", json=body, timeout=timeout, **kw)


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


# ---------------------------------------------------------------------------------------------- stop_regex

# Exponential for a backtracking engine on any text without a NUL: (.|.)* tries 2^n ways to fail at n characters
# (Python's re takes ~5 s at 20 characters). One such pattern froze the gateway's only event loop.
REDOS = r"(?s)(.|.)*\x00"


def test_a_backtracking_stop_regex_costs_linear_time(mesh) -> None:  # noqa: ANN001
    with watched(mesh):
        for stream in (False, True):
            # Greedy: a sampled text could hold a NUL of its own (the random model's vocabulary has one), and
            # then the pattern rightly matches.
            body = {"model": "tiny", "prompt": "a story", "max_tokens": 60, "ignore_eos": True, "stream": stream,
                    "temperature": 0, "stop_regex": [REDOS, r"(a|aa)+\x00"]}
            r = post(mesh, "/v1/completions", body, timeout=60)
            assert r.status_code == 200, r.text
            if not stream:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post(mesh, "/generate", {"text": "a story", "stream": False, "sampling_params": {
            "max_new_tokens": 60, "ignore_eos": True, "temperature": 0, "stop_regex": REDOS}})
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(("pattern", "says"), [
    (r"(a)\1", "RE2"),  # a backreference: no linear-time engine runs it
    (r"(?=a)b", "RE2"),  # lookaround
    ("a" * (MAX_STOP_REGEX_CHARS + 1), "too long"),
    (r"a{1000}{1000}", "RE2"),
])
def test_a_stop_regex_re2_refuses_is_a_400(mesh, pattern: str, says: str) -> None:  # noqa: ANN001
    err = error(post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "stop_regex": pattern}))
    assert err["param"] == "stop_regex" and says in err["message"]


def test_a_stop_regex_still_stops(mesh) -> None:  # noqa: ANN001
    base = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "a story", "max_tokens": 40, "temperature": 0,
                                          "ignore_eos": True}).json()["choices"][0]["text"]
    probe = base[5:8]
    pattern = "".join("\\" + c if not c.isalnum() else c for c in probe)
    for stream in (False, True):
        r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "a story", "max_tokens": 40, "temperature": 0,
                                           "ignore_eos": True, "stop_regex": pattern, "stream": stream})
        text = r.json()["choices"][0]["text"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
            if line.startswith("data: {"))
        assert text == base[: base.index(probe)]


# ----------------------------------------------------------------------------------- chat_template_kwargs


@pytest.mark.parametrize("kwargs", [
    {"padding": "max_length", "max_length": 5_000_000},
    {"tokenizer_kwargs": {"padding": "max_length", "max_length": 5_000_000}},
    {"chat_template": "{{ 'x' * 100 }}"},
    {"return_tensors": "np"},
    {"truncation": True},
    {"tokenize": False},
])
def test_tokenizer_arguments_in_chat_template_kwargs_are_400s_by_name(mesh, kwargs: dict) -> None:  # noqa: ANN001
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": kwargs}
    err = error(post(mesh, "/v1/chat/completions", body))
    assert err["param"] == "chat_template_kwargs" and next(iter(kwargs)) in err["message"]


def test_tokenizer_arguments_sent_over_the_bus_are_refused_too(mesh) -> None:  # noqa: ANN001
    # A gateway credential (or any bus client) talking to the tokenizer directly meets the same rule.
    async def ask() -> bus.RemoteError | EncodeReply:
        try:
            return await bus.request(mesh.nc, subjects.TOKENIZER_ENCODE, EncodeRequest(
                messages=[ChatMessage(role="user", content="hi")],
                template_kwargs_json=json.dumps({"padding": "max_length", "max_length": 5_000_000})),
                timeout=30, expect=EncodeReply)
        except bus.RemoteError as e:
            return e
    got = mesh.call(ask())
    assert isinstance(got, bus.RemoteError) and "padding" in got.message


def test_only_variables_the_template_reads_reach_it(mesh, client) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1).usage.prompt_tokens
    junk = {f"v{i}": "x" * 100 for i in range(50)}
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1,
                                       extra_body={"chat_template_kwargs": junk})
    assert r.usage.prompt_tokens == plain


# ---------------------------------------------------------------------------------------- chat_template


def test_a_request_chat_template_is_refused_unless_trusted(mesh) -> None:  # noqa: ANN001
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}
    err = error(post(mesh, "/v1/chat/completions", body))
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


HOSTILE_TEMPLATES = {
    "cpu": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "memory": "{{ 'a' * 10**10 }}",
    "output": "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}",
}


def _sandbox_attack(mesh, names: list[str], again: bool) -> None:  # noqa: ANN001
    """The tokenizer renders a request's template (when the gateway trusts them) in a limited child process:
    attacked over the bus, it answers 400s while it keeps encoding for everyone else."""
    import asyncio

    tok = mesh.tokenizer
    tok.sandbox.limits = SandboxLimits(wall_s=4.0, cpu_s=1.0, memory_bytes=512 << 20, max_ids=200_000)

    async def encode(template: str | None, prompt: str | None = None) -> tuple[float, object]:
        t0 = time.monotonic()
        req = EncodeRequest(prompt=prompt) if prompt else EncodeRequest(
            messages=[ChatMessage(role="user", content="y" * 2000)], chat_template=template)
        try:
            got: object = await bus.request(mesh.nc, subjects.TOKENIZER_ENCODE, req, timeout=60, expect=EncodeReply)
        except bus.RemoteError as e:
            got = e
        return time.monotonic() - t0, got

    async def attack() -> list[tuple[float, object]]:
        await encode("{{ messages[0].content }}")  # the sandbox is up (its first start loads a tokenizer)
        out = []
        for name in names:
            hostile = asyncio.ensure_future(encode(HOSTILE_TEMPLATES[name]))
            await asyncio.sleep(0.3)
            out.append(await encode(None, prompt="someone else's prompt"))  # while the hostile one renders
            out.append(await hostile)
        return out

    with watched(mesh):
        results = mesh.call(attack(), timeout=120)
    for (t_other, other), (t_bad, bad), name in zip(results[::2], results[1::2], names):
        assert isinstance(other, EncodeReply) and t_other < HEALTH_BOUND_S, (name, t_other)
        assert isinstance(bad, bus.RemoteError) and bad.code == "bad_request", (name, bad)
        assert t_bad < 30, (name, t_bad)
    assert tok.sandbox.kills >= 1
    if again:
        _, ok = mesh.call(encode("{{ messages[0].content }}"), timeout=120)
        assert isinstance(ok, EncodeReply)  # a killed sandbox is started again


def test_a_request_template_burning_cpu_is_killed_in_its_sandbox(mesh) -> None:  # noqa: ANN001
    _sandbox_attack(mesh, ["cpu"], again=False)


@pytest.mark.slow
def test_every_hostile_request_template_is_contained_in_its_sandbox(mesh) -> None:  # noqa: ANN001
    _sandbox_attack(mesh, list(HOSTILE_TEMPLATES), again=True)


# ------------------------------------------------------------------------------------- structured outputs


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_deep_or_large_schemas_are_400s_and_never_reach_the_engine(mesh) -> None:  # noqa: ANN001
    d0 = mesh.decoders["d0"]
    before = d0.thread.grammar_compiles.compiled
    with watched(mesh):
        # 400 nested objects: ~5 s of xgrammar on the engine thread, before.
        deep = {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(400)}}
        err = error(post(mesh, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 2, "response_format": deep}))
        assert err["param"] == "response_format" and str(MAX_SCHEMA_DEPTH) in err["message"]
        wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 40}
                                                 for i in range(MAX_STRUCTURED_SPEC_CHARS // 40)}}
        err = error(post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                   "structured_outputs": {"json": wide}}))
        assert err["param"] == "structured_outputs" and "characters" in err["message"]
        err = error(post(mesh, "/generate", {"text": "x", "sampling_params": {
            "max_new_tokens": 2, "json_schema": json.dumps(nested_schema(400))}}))
        assert "json_schema" in json.dumps(err)
        tools = [{"type": "function", "function": {"name": "f", "parameters": nested_schema(400)}}]
        err = error(post(mesh, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                        "max_tokens": 2, "tools": tools, "tool_choice": "required"}))
        assert err["param"].startswith("tools") and str(MAX_SCHEMA_DEPTH) in err["message"]
    assert d0.thread.grammar_compiles.compiled == before


def test_a_schema_within_bounds_compiles_off_the_engine_thread(mesh) -> None:  # noqa: ANN001
    d0 = mesh.decoders["d0"]
    before = d0.thread.grammar_compiles.compiled
    schema = nested_schema(MAX_SCHEMA_DEPTH // 2 - 1)
    with watched(mesh):
        r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                           "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    assert d0.thread.grammar_compiles.compiled == before + 1
    backend = d0.thread.engine.grammar()
    assert backend.compiler is not None  # xgrammar's cache has a byte limit (shared/engine/grammar.py)


# ------------------------------------------------------------------------------------ SGLang streaming


def test_sglang_generate_streams_increments(mesh) -> None:  # noqa: ANN001
    body = {"text": "a story", "stream": True, "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    events = []
    with watched(mesh), httpx.stream("POST", f"{mesh.url}/generate", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    ids = [t for e in events for t in e["output_ids"]]
    assert len(ids) == 100 and events[-1]["meta_info"]["completion_tokens"] == 100
    # Every event carries what is new: never the whole output again, the prompt's logprobs once.
    assert max(len(e["output_ids"]) for e in events) < 40
    assert sum(len(e["meta_info"]["output_token_logprobs"]) for e in events) == 100
    assert sum("input_token_logprobs" in e["meta_info"] for e in events) == 1
    whole = post(mesh, "/generate", {**body, "stream": False, "sampling_params": {
        "max_new_tokens": 100, "ignore_eos": True, "temperature": 0}}).json()
    assert len(whole["output_ids"]) == 100 and len(whole["meta_info"]["input_token_logprobs"]) > 0


# ------------------------------------------------------------------------------------ work amplification


def test_logit_bias_is_capped_as_openai_caps_it(mesh) -> None:  # noqa: ANN001
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    err = error(post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "logit_bias": bias}))
    assert err["param"] == "logit_bias" and str(MAX_LOGIT_BIAS) in err["message"]
    ok = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2,
                                        "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS)}})
    assert ok.status_code == 200


def test_requests_are_admitted_by_their_cost(mesh) -> None:  # noqa: ANN001
    limit = mesh.gateway.ctx.max_model_len()
    budget = REQUEST_COST_CONTEXTS * limit
    words = "word " * (limit // 2 - 8)
    with watched(mesh):
        # /v1/score: every item x label is a whole prefill with logprobs at each prompt position.
        r = post(mesh, "/v1/score", {"query": words, "items": [f" item {i}" for i in range(32)],
                                     "label_token_ids": [1, 2]})
        err = error(r)
        assert err["code"] == "request_too_costly" and str(budget) in err["message"]
        # 8 prompts x n=8: 64 choices of up to half a context each.
        r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 8, "n": 8, "max_tokens": limit // 2})
        assert error(r)["code"] == "request_too_costly"
        # best_of counts with n: its sequences are all computed.
        r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 9, "n": 1, "best_of": 8,
                                           "use_beam_search": True, "max_tokens": 2})
        assert "best_of" in error(r)["message"]
        # Beam search sends every live beam's whole context each step.
        r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": [7] * (limit // 2), "n": 8,
                                           "use_beam_search": True, "max_tokens": limit // 4})
        assert error(r)["code"] == "request_too_costly" and "beam search" in error(r)["message"]
    ok = post(mesh, "/v1/score", {"query": "a question", "items": [" yes", " no"], "label_token_ids": [1, 2]})
    assert ok.status_code == 200 and len(ok.json()["scores"]) == 2


# -------------------------------------------------------------------------------- a client that stops reading


def test_a_client_that_stops_reading_loses_its_stream(mesh) -> None:  # noqa: ANN001
    ctx = mesh.gateway.ctx
    host, port = mesh.url.removeprefix("http://").rsplit(":", 1)
    # 64 choices, each first event with every prompt position's 20 likeliest tokens: ~8 MB, more than the socket
    # buffers on both ends hold (Linux lets loopback's grow to 4 MiB).
    prompts = [list(range(5 + k, 105 + k)) for k in range(8)]
    body = json.dumps({"model": "tiny", "prompt": prompts, "max_tokens": 4, "prompt_logprobs": 20, "n": 8,
                       "stream": True, "ignore_eos": True}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read a byte of the answer
    with contextlib.closing(s):
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        mesh.wait_until(lambda: ctx.in_flight >= 1, timeout=10)
        # Its place among the requests in flight is given back and the worker drops it, the socket still open.
        mesh.wait_until(lambda: ctx.in_flight == 0 and mesh.held("d0") == 0, timeout=WRITE_TIMEOUT_S + 90)
    ok = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------------------------------------------ priority


def test_priority_needs_the_priority_policy(mesh) -> None:  # noqa: ANN001
    err = error(post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": 5}))
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]
    err = error(post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": 10**9}))
    assert "priority" in json.dumps(err)
    assert post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": 0}).status_code == 200


# ------------------------------------------------------------------------- browsers, Host and /health


@pytest.mark.parametrize("path", ["/generate", "/invocations", "/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_web_page_cannot_post_without_a_preflight(mesh, path: str, content_type: str | None) -> None:  # noqa: ANN001
    # What a page can send cross-origin with no CORS preflight: a text/plain, form or untyped body.
    body = json.dumps({"model": "tiny", "text": "x", "prompt": "x", "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 1})
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{mesh.url}{path}", content=body, headers=headers, timeout=30)
    if content_type is None:  # httpx sends none; make sure
        assert "content-type" not in r.request.headers
    assert error(r, 415)["code"] == "unsupported_media_type"


def test_a_rebound_host_name_is_refused(mesh) -> None:  # noqa: ANN001
    r = httpx.get(f"{mesh.url}/v1/models", headers={"Host": "attacker.example:8000"}, timeout=30)
    assert error(r)["code"] == "untrusted_host"
    r = post(mesh, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
             headers={"Host": "attacker.example"})
    assert error(r)["code"] == "untrusted_host"
    for name in ("localhost", "127.0.0.1"):
        port = mesh.url.rsplit(":", 1)[1]
        assert httpx.get(f"{mesh.url}/v1/models", headers={"Host": f"{name}:{port}"}, timeout=30).status_code == 200


def test_health_costs_one_tokenizer_round_trip_a_second(mesh) -> None:  # noqa: ANN001
    def hammer() -> None:
        with httpx.Client(timeout=30) as c:
            for _ in range(25):
                assert c.get(f"{mesh.url}/health").status_code == 200

    probe = mesh.gateway._server.config.app.state.tokenizer_probe  # the FastAPI app uvicorn serves
    before = probe.rounds
    t0 = time.monotonic()
    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    elapsed = time.monotonic() - t0
    assert probe.rounds - before <= elapsed / probe.ttl_s + 2
