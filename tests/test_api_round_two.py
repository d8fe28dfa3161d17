"""vLLM/SGLang API parity, round two (issue 23): JSON mode means an object, continuous usage in chat
streams, vLLM's stop_reason and SGLang's matched_stop, logprobs validation and bytes/text_offset across
split characters, chat roles and template extras, logit_bias errors naming every key, cached_tokens,
/invocations, /get_load and /get_server_info, and vLLM's metric names with counts from a known set of
requests. Real nats-server, tokenizer service and decode worker; the real openai client (raw HTTP where
it has no field)."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

# A template that shows what it was given: any role verbatim, documents, a template variable, and the
# generation prompt only when asked (so continue_final_message and add_generation_prompt are visible).
TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if documents -%}{%- for d in documents -%}<doc>{{ d.title }}: {{ d.text }}</doc>\n{%- endfor -%}{%- endif -%}"
    "{%- if style is defined -%}<style>{{ style }}</style>\n{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    path = build_checkpoint("llama", tmp_path_factory.mktemp("round2") / "llama").path
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_file.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tok(model_dir):  # noqa: ANN001, ANN201
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, model_dir=model_dir) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


USER = [{"role": "user", "content": "Say something."}]


def chat(client, stream=False, **kw):  # noqa: ANN001, ANN003, ANN201
    kw.setdefault("messages", USER)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", stream=stream, **kw)


def completion(client, **kw):  # noqa: ANN001, ANN003, ANN201
    kw.setdefault("temperature", 0)
    return client.completions.create(model="tiny", **kw)


def streamed_text(chunks) -> tuple[str, list]:  # noqa: ANN001
    chunks = list(chunks)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


# ------------------------------------------------------------------------------- JSON mode


def test_json_object_mode_never_starts_an_array(client, tok) -> None:  # noqa: ANN001
    # The model is pushed hard towards "[" and "[ " openings: JSON mode must still answer an object.
    brackets = {str(i): 100 for i in range(len(tok)) if tok.decode([i]).strip().startswith("[")}
    assert brackets
    fmt = {"type": "json_object"}
    r = chat(client, max_tokens=40, response_format=fmt, logit_bias=brackets)
    assert r.choices[0].message.content.lstrip().startswith("{"), r.choices[0].message.content
    text, _ = streamed_text(chat(client, stream=True, max_tokens=40, response_format=fmt, logit_bias=brackets))
    assert text.lstrip().startswith("{"), text
    # A schema that asks for an array still gets one (only JSON mode means an object).
    r = chat(client, max_tokens=40, logit_bias=brackets,
             extra_body={"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}}})
    assert r.choices[0].message.content.lstrip().startswith("[")
    expect_error(openai.BadRequestError, lambda: chat(client, max_tokens=4, response_format={"type": "json_objekt"}),
                 400, "response_format.type")


# ------------------------------------------------------------------------ continuous usage


def test_continuous_usage_stats_in_chat_streams(client) -> None:  # noqa: ANN001
    chunks = list(chat(client, stream=True, max_tokens=6, extra_body={"ignore_eos": True},
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks), "every chunk carries usage"
    prompt = chunks[-1].usage.prompt_tokens
    assert all(c.usage.prompt_tokens == prompt for c in chunks)
    running = [c.usage.completion_tokens for c in chunks]
    assert running[0] == 0 and running == sorted(running) and running[-1] == 6
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)
    # Without it, usage only in the last chunk.
    chunks = list(chat(client, stream=True, max_tokens=3, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    for bad in ("yes", 1):
        msg = expect_error(openai.BadRequestError, lambda: chat(client, stream=True, max_tokens=2, stream_options={
            "include_usage": True, "continuous_usage_stats": bad}), 400, "stream_options.continuous_usage_stats")
        assert "continuous_usage_stats" in msg


# ------------------------------------------------------------------- stop_reason / matched_stop


def _finish(choice) -> tuple:  # noqa: ANN001
    extra = choice.model_extra or {}
    return choice.finish_reason, extra.get("stop_reason"), extra.get("matched_stop")


def test_stop_reason_and_matched_stop(client, model_dir) -> None:  # noqa: ANN001
    # A stop token id (forced by logit_bias, so it is the first token): both name it.
    kw = dict(max_tokens=8, logit_bias={"42": 100}, extra_body={"stop_token_ids": [42]})
    assert _finish(chat(client, **kw).choices[0]) == ("stop", 42, 42)
    assert _finish(completion(client, prompt="x", **kw).choices[0]) == ("stop", 42, 42)
    _, chunks = streamed_text(chat(client, stream=True, **kw))
    last = [c for c in chunks if c.choices][-1]
    assert _finish(last.choices[0]) == ("stop", 42, 42)
    # A stop string, including one completed by the last streamed chunk.
    base = completion(client, prompt="Once upon", max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:9]
    assert stop.strip() and base.find(stop) == 5, base
    r = completion(client, prompt="Once upon", max_tokens=12, stop=[stop, "zzzz"], extra_body={"ignore_eos": True})
    assert _finish(r.choices[0]) == ("stop", stop, stop) and r.choices[0].text == base[:base.index(stop)]
    text, chunks = streamed_text(completion(client, prompt="Once upon", max_tokens=12, stop=[stop], stream=True,
                                            extra_body={"ignore_eos": True}))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and _finish(finals[0].choices[0]) == ("stop", stop, stop) and text == base[:base.index(stop)]
    # eos: vLLM's stop_reason is null, SGLang's matched_stop the eos token id.
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]  # what the engine stops on
    r = completion(client, prompt="x", max_tokens=8, logit_bias={str(eos): 100})
    assert _finish(r.choices[0]) == ("stop", None, eos)
    # length: both null, streaming and not.
    assert _finish(chat(client, max_tokens=2, extra_body={"ignore_eos": True}).choices[0]) == ("length", None, None)
    _, chunks = streamed_text(chat(client, stream=True, max_tokens=2, extra_body={"ignore_eos": True}))
    assert _finish([c for c in chunks if c.choices][-1].choices[0]) == ("length", None, None)


# ------------------------------------------------------------------------------ logprobs


def test_logprobs_validation_as_vllm(client) -> None:  # noqa: ANN001
    chat_bad = [({"logprobs": 5}, "logprobs"), ({"logprobs": "true"}, "logprobs"),
                ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                ({"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
                ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
                ({"top_logprobs": 2}, "top_logprobs")]  # top_logprobs without logprobs
    for body, param in chat_bad:
        for stream in (False, True):
            expect_error(openai.BadRequestError, lambda: chat(client, stream=stream, max_tokens=2, extra_body=body),
                         400, param)
    for value in (True, 21, -1, "1", 1.5):
        expect_error(openai.BadRequestError, lambda: completion(client, prompt="x", max_tokens=2,
                                                               extra_body={"logprobs": value}), 400, "logprobs")
    r = chat(client, max_tokens=2, logprobs=True, top_logprobs=20)
    assert all(len(t.top_logprobs) == 20 for t in r.choices[0].logprobs.content)
    r = completion(client, prompt="x", max_tokens=2, logprobs=20)
    assert all(1 <= len(t) <= 20 for t in r.choices[0].logprobs.top_logprobs)  # keyed by text: split bytes collide
    r = chat(client, max_tokens=2, logprobs=True, top_logprobs=0)
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)


EMOJI = "😀✓é"  # 4 + 3 + 2 bytes: each split over byte tokens by the byte-level BPE


def test_bytes_and_text_offset_across_split_characters(client) -> None:  # noqa: ANN001
    force = {"structured_outputs": {"choice": [EMOJI]}}
    r = chat(client, max_tokens=20, logprobs=True, top_logprobs=2, extra_body=force)
    assert r.choices[0].message.content == EMOJI
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content)
    assert joined.startswith(EMOJI.encode()), joined  # the characters rebuilt from their tokens' bytes
    assert len(content) > len(EMOJI)  # they really were split
    assert all(len(t.bytes) <= 4 for t in content[:-1])
    _, chunks = streamed_text(chat(client, stream=True, max_tokens=20, logprobs=True, extra_body=force))
    streamed = b"".join(bytes(t.bytes) for c in chunks if c.choices and c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content)
    assert streamed.startswith(EMOJI.encode())
    # Completions: offsets index the text in characters; a token that starts a character sits at it.
    for stream in (False, True):
        got = completion(client, prompt="x", max_tokens=20, logprobs=0, stream=stream, extra_body=force)
        chunks = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        assert text == EMOJI
        assert offsets == sorted(offsets) and set(range(len(EMOJI))) <= set(offsets) <= set(range(len(EMOJI) + 1))
    # echo: the prompt's own split characters count the same way.
    r = completion(client, prompt="a" + EMOJI, max_tokens=1, logprobs=0, echo=True, extra_body={"ignore_eos": True})
    offsets = r.choices[0].logprobs.text_offset
    assert r.choices[0].text.startswith("a" + EMOJI)
    assert offsets == sorted(offsets) and {0, 1, 2, 3} <= set(offsets) and offsets[-1] == 4


# ------------------------------------------------------------------- chat roles and template


def _prompt_tokens(client, stream: bool, **kw) -> int:  # noqa: ANN001, ANN003
    if not stream:
        return chat(client, max_tokens=1, **kw).usage.prompt_tokens
    chunks = list(chat(client, stream=True, max_tokens=1, stream_options={"include_usage": True}, **kw))
    return chunks[-1].usage.prompt_tokens


def test_custom_roles_and_template_extras(client, tok) -> None:  # noqa: ANN001
    def expected(messages, **template) -> int:  # noqa: ANN001, ANN003
        template.setdefault("add_generation_prompt", True)
        return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **template))

    custom = [{"role": "ipython", "content": "result = 42"}, {"role": "user", "content": "What is result?"}]
    partial = USER + [{"role": "assistant", "content": "Once upon a"}]
    docs = [{"title": "Paris", "text": "The capital of France."}, {"title": "Rome", "text": "Italy's capital."}]
    for stream in (False, True):
        assert _prompt_tokens(client, stream, messages=custom) == expected(custom)
        # continue_final_message: the assistant message is continued, no new turn opened.
        got = _prompt_tokens(client, stream, messages=partial,
                             extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert got == expected(partial, add_generation_prompt=False, continue_final_message=True)
        assert got < expected(partial, add_generation_prompt=False)  # its <|im_end|> is gone
        assert _prompt_tokens(client, stream, messages=USER, extra_body={"add_generation_prompt": False}) == \
            expected(USER, add_generation_prompt=False)
        assert _prompt_tokens(client, stream, messages=USER, extra_body={"documents": docs}) == expected(USER, documents=docs)
        assert _prompt_tokens(client, stream, messages=USER, extra_body={"chat_template_kwargs": {"style": "terse"}}) == \
            expected(USER, style="terse")
    # The continued text follows on from the assistant's words.
    r = chat(client, messages=partial, max_tokens=4,
             extra_body={"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    bad = [({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
           ({"messages": [{"role": "r" * 65, "content": "x"}]}, "messages.0.role"),
           ({"messages": partial, "continue_final_message": True}, "continue_final_message"),  # with the default gen prompt
           ({"messages": USER, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
           ({"messages": USER, "continue_final_message": "yes"}, "continue_final_message"),
           ({"messages": USER, "add_generation_prompt": 1}, "add_generation_prompt"),
           ({"messages": USER, "documents": "Paris"}, "documents"),
           ({"messages": USER, "documents": ["Paris"]}, "documents.0"),
           ({"messages": USER, "chat_template_kwargs": ["style"]}, "chat_template_kwargs")]
    for body, param in bad:
        messages = body.pop("messages")
        for stream in (False, True):
            expect_error(openai.BadRequestError, lambda: chat(client, stream=stream, messages=messages, max_tokens=2,
                                                             extra_body=dict(body)), 400, param)


# ----------------------------------------------------------------------------- logit_bias


def test_logit_bias_error_names_every_bad_key(client, mesh) -> None:  # noqa: ANN001
    vocab = mesh.gateway.ctx.vocab_size
    bias = {"abc": 1, "-5": 1, str(vocab + 7): 1, "3": 500, "4": -101, "5": 2}
    for stream in (False, True):
        msg = expect_error(openai.BadRequestError, lambda: chat(client, stream=stream, max_tokens=2, logit_bias=bias),
                           400, "logit_bias")
        for part in ("'abc'", "-5", str(vocab + 7), "3 (500)", "4 (-101)"):
            assert part in msg, (part, msg)
        assert "5 (" not in msg  # the good key is not blamed
    msg = expect_error(openai.BadRequestError, lambda: completion(client, prompt="x", max_tokens=2, logit_bias=bias),
                       400, "logit_bias")
    assert "'abc'" in msg and str(vocab + 7) in msg


# ---------------------------------------------------------------------------- cached tokens


def test_cached_tokens_count_prompt_tokens_from_the_cache(client) -> None:  # noqa: ANN001
    prompt = "The mesh keeps KV blocks of long prompts. " * 8
    first = completion(client, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = completion(client, prompt=prompt + " Again.", max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached <= first.usage.prompt_tokens  # the shared prefix's whole blocks
    chunks = list(completion(client, prompt=prompt + " Once more.", max_tokens=2, stream=True,
                             stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    messages = [{"role": "user", "content": prompt}]
    chat(client, messages=messages, max_tokens=1)
    r = chat(client, messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


# ------------------------------------------------------------------------------ endpoints


def test_invocations_routes_by_body(client, mesh) -> None:  # noqa: ANN001
    url = f"{mesh.url}/invocations"
    as_chat = {"messages": USER, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url, json=as_chat, timeout=30).json()
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["content"] == chat(client, max_tokens=4, extra_body={"ignore_eos": True}).choices[0].message.content
    as_completion = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url, json=as_completion, timeout=30).json()
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"] == completion(client, prompt="Once upon", max_tokens=4,
                                                 extra_body={"ignore_eos": True}).choices[0].text
    with httpx.stream("POST", url, json=as_chat | {"stream": True}, timeout=30) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["object"] == "chat.completion.chunk"
    for body, param in (({"max_tokens": 2}, "messages"), ({"messages": USER, "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "logprobs": True}, "logprobs"), ({"messages": "hi"}, "messages")):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url, content=b"[1, 2]", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400
    # SageMaker's health check goes with it.
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{mesh.url}/ping", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"


def test_get_load_and_server_info(client, mesh) -> None:  # noqa: ANN001
    load = httpx.get(f"{mesh.url}/get_load", timeout=5).json()
    assert load["num_decode_workers"] == 1 and load["num_running_reqs"] == 0
    (worker,) = load["workers"]
    assert worker["worker_id"] == "d0" and worker["role"] == "decode" and worker["total_blocks"] > 0
    # While a long request streams, the worker shows it running and its KV in use.
    stream = chat(client, stream=True, max_tokens=400, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    deadline = time.monotonic() + 5
    while True:
        load = httpx.get(f"{mesh.url}/get_load", timeout=5).json()
        if load["num_running_reqs"] == 1:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.05)
    (worker,) = load["workers"]
    assert worker["num_running_reqs"] == 1 and worker["num_reqs"] == 1 and worker["kv_usage"] > 0
    assert worker["num_tokens"] > 0 and load["gateway_requests_in_flight"] == 1
    info = httpx.get(f"{mesh.url}/get_server_info", timeout=5).json()
    assert info["served_model_name"] == "tiny" and info["max_model_len"] > 0
    assert [w["worker_id"] for w in info["internal_states"]] == ["d0"] and info["load"]["num_decode_workers"] == 1
    stream.close()


# -------------------------------------------------------------------------------- metrics


def _samples(mesh) -> dict[tuple[str, str], float]:  # noqa: ANN001
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{mesh.url}/metrics", timeout=5).text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name",))
            out[(s.name, labels)] = s.value
    return out


VLLM_TEXT_MODEL_NAMES = [  # vLLM's /metrics for a text model (v1 engine), under kvmesh: instead of vllm:
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
    "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
    "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
    "request_time_per_output_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "cache_config_info",
]


def test_metrics_have_vllm_names_and_count_a_known_set_of_requests(client, mesh) -> None:  # noqa: ANN001
    text = httpx.get(f"{mesh.url}/metrics", timeout=5).text
    for name in VLLM_TEXT_MODEL_NAMES:
        assert re.search(rf"^# TYPE kvmesh:{name}(_total)? ", text, re.M), name  # counters: _total, as in vLLM
    before = _samples(mesh)
    # A known set: n=1 x max_tokens 5, n=3 x max_tokens 4 (chat), a batch of 2 prompts n=2 x max_tokens 3.
    completion(client, prompt="one", max_tokens=5, extra_body={"ignore_eos": True})
    chat(client, max_tokens=4, n=3, temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    list(completion(client, prompt=["two", "three"], max_tokens=3, n=2, temperature=1.0, seed=2, stream=True,
                    extra_body={"ignore_eos": True}))
    time.sleep(0.2)
    after = _samples(mesh)

    def delta(name: str, labels: str = "") -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    p = "kvmesh:"
    assert delta(f"{p}request_params_n_count") == 4  # 1 + 1 + 2 prompts
    assert delta(f"{p}request_params_n_sum") == 1 + 3 + 2 + 2
    assert delta(f"{p}request_params_n_bucket", "le=1.0") == 1 and delta(f"{p}request_params_n_bucket", "le=2.0") == 3
    assert delta(f"{p}request_params_max_tokens_count") == 1 + 3 + 4  # per choice, as vLLM observes it
    assert delta(f"{p}request_params_max_tokens_sum") == 5 + 3 * 4 + 4 * 3
    assert delta(f"{p}request_max_num_generation_tokens_count") == 4
    assert delta(f"{p}request_max_num_generation_tokens_sum") == 5 + 4 + 3 + 3
    assert delta(f"{p}generation_tokens_total") == 5 + 12 + 12
    assert delta(f"{p}request_success_total", "finished_reason=length") == 1 + 3 + 4
    assert delta(f"{p}request_generation_tokens_count") == 8
    # Time per output token: one per choice with more than one token; inter-token and its older name agree.
    assert delta(f"{p}request_time_per_output_token_seconds_count") == 8
    assert delta(f"{p}time_per_output_token_seconds_count") == delta(f"{p}inter_token_latency_seconds_count") > 0
    assert delta(f"{p}time_to_first_token_seconds_count") == 3
    assert delta(f"{p}e2e_request_latency_seconds_count") == 3


# ---------------------------------------------------------------------------------- score


def test_score_gives_label_probabilities_after_query_and_item(client, mesh, tok) -> None:  # noqa: ANN001
    url = f"{mesh.url}/v1/score"
    labels = [tok.encode(" yes", add_special_tokens=False)[-1], tok.encode(" no", add_special_tokens=False)[-1], 7]
    body = {"query": "Is Paris in France? Answer:", "items": [" Paris", " Rome is not"], "label_token_ids": labels}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and len(out["scores"]) == 2 and all(len(row) == 3 for row in out["scores"])
    # Each score is the label's probability after query + item: what echo's prompt logprobs give for that token.
    for item, row in zip(body["items"], out["scores"]):
        ids = tok.encode(body["query"] + item)
        for label, p in zip(labels, row):
            echo = completion(client, prompt=ids + [label], max_tokens=1, echo=True, logprobs=0)
            expected = echo.choices[0].logprobs.token_logprobs[len(ids)]
            assert abs(p - 2.718281828459045 ** expected) < 1e-4 * max(1.0, p), (item, label)
    soft = httpx.post(url, json=body | {"apply_softmax": True}, timeout=60).json()["scores"]
    for raw, norm in zip(out["scores"], soft):
        assert abs(sum(norm) - 1) < 1e-6 and all(abs(n - r / sum(raw)) < 1e-6 for r, n in zip(raw, norm))
    # Token ids and item_first.
    q, items = tok.encode("Answer:", add_special_tokens=False), [tok.encode(" A", add_special_tokens=False)]
    first = httpx.post(url, json={"query": q, "items": items, "label_token_ids": labels, "item_first": True},
                       timeout=60).json()["scores"][0]
    echo = completion(client, prompt=items[0] + q + [labels[0]], max_tokens=1, echo=True, logprobs=0)
    assert abs(first[0] - 2.718281828459045 ** echo.choices[0].logprobs.token_logprobs[len(q) + 1]) < 1e-4
    vocab = mesh.gateway.ctx.vocab_size
    for bad, param in (({"label_token_ids": []}, "label_token_ids"), ({"label_token_ids": [vocab]}, "label_token_ids"),
                       ({"label_token_ids": ["3"]}, "label_token_ids.0"), ({"items": []}, "items"),
                       ({"items": [[1, 2]]}, None), ({"apply_softmax": "yes"}, "apply_softmax"),
                       ({"model": "other"}, "model")):
        r = httpx.post(url, json=body | bad, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (bad, r.text)


# ------------------------------------------------------- SGLang's constraints, token ids as tokens


def test_sglang_top_level_constraints(client) -> None:  # noqa: ANN001
    for stream in (False, True):
        got = completion(client, prompt="Phone:", max_tokens=20, temperature=1.0, seed=3, stream=stream,
                         extra_body={"regex": r"\d{3}-\d{2}"})
        text = "".join(c.choices[0].text for c in got if c.choices) if stream else got.choices[0].text
        assert re.fullmatch(r"\d{3}-\d{2}", text), text
    r = chat(client, max_tokens=20, temperature=1.0, seed=4, extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = chat(client, max_tokens=30, extra_body={"json_schema": json.dumps(schema)})
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    for body, param in (({"regex": "a", "ebnf": 'root ::= "a"'}, "regex"),
                        ({"json_schema": "{", }, "json_schema"),
                        ({"regex": "a", "response_format": {"type": "json_object"}}, "regex"),
                        ({"ebnf": 3}, "ebnf")):
        for stream in (False, True):
            expect_error(openai.BadRequestError, lambda: chat(client, stream=stream, max_tokens=2, extra_body=body),
                         400, param)
    msg = expect_error(openai.BadRequestError, lambda: chat(client, max_tokens=2, extra_body={"regex": "(unclosed"}), 400)
    assert "regex" in msg


def test_return_tokens_as_token_ids(client) -> None:  # noqa: ANN001
    force = {"structured_outputs": {"choice": [EMOJI]}, "return_tokens_as_token_ids": True}
    r = completion(client, prompt="x", max_tokens=20, logprobs=2, extra_body=force)
    lp = r.choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in lp.tokens)
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp.top_logprobs for k in top)
    assert len({t for t in lp.tokens}) >= 3  # split bytes no longer collapse into one text
    r = chat(client, max_tokens=20, logprobs=True, top_logprobs=2, extra_body=force)
    content = r.choices[0].logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in content)
    assert b"".join(bytes(t.bytes) for t in content).startswith(EMOJI.encode())  # bytes stay the token's own
    expect_error(openai.BadRequestError, lambda: chat(client, max_tokens=2, extra_body={"return_tokens_as_token_ids": "yes"}),
                 400, "return_tokens_as_token_ids")


def test_min_tokens_holds_back_stop_token_ids(client) -> None:  # noqa: ANN001
    """vLLM's min_tokens masks eos and the stop_token_ids until that many tokens are out."""
    kw = dict(max_tokens=8, logit_bias={"42": 100}, extra_body={"stop_token_ids": [42], "min_tokens": 3})
    r = completion(client, prompt="x", logprobs=0, **kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4  # 3 held back, then 42
    assert _finish(r.choices[0]) == ("stop", 42, 42)
    _, chunks = streamed_text(chat(client, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens == 4
