"""OpenAI/vLLM API parity (issue 11): prompt lists, echo, logit_bias and vLLM's sampling extras, the small
endpoints (/v1/models/{id}, /tokenize, /detokenize, /version), continuous usage stats and strict field
types, through the real openai client against a real nats-server, tokenizer service and decode worker."""
from __future__ import annotations

import httpx
import torch
import openai
import pytest

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("parity") / "llama")


@pytest.fixture(scope="module")
def mesh(ckpt, tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, model_dir=ckpt.path) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


def greedy(client: openai.OpenAI, **kw):  # noqa: ANN003, ANN201
    extra = {"ignore_eos": True} | kw.pop("extra_body", {})
    return client.completions.create(model="tiny", temperature=0, extra_body=extra, **kw)


def test_a_list_of_prompts_gives_n_choices_per_prompt_in_order(client) -> None:  # noqa: ANN001
    prompts = ["Once upon a time", "The quick brown fox", "Hi"]
    alone = [greedy(client, prompt=p, max_tokens=6).choices[0].text for p in prompts]
    r = greedy(client, prompt=prompts, max_tokens=6, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    single_usage = [greedy(client, prompt=p, max_tokens=6).usage.prompt_tokens for p in prompts]
    assert r.usage.prompt_tokens == sum(single_usage) and r.usage.completion_tokens == 36
    chunks = list(greedy(client, prompt=prompts[:2], max_tokens=6, stream=True))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == alone[:2]
    ids = [[1, 2, 3], [4, 5, 6]]
    r = greedy(client, prompt=ids, max_tokens=3)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == 6


def test_echo_puts_the_prompt_first(client) -> None:  # noqa: ANN001
    plain = greedy(client, prompt="Hello there", max_tokens=5).choices[0].text
    assert greedy(client, prompt="Hello there", max_tokens=5, echo=True).choices[0].text == "Hello there" + plain
    streamed = "".join(c.choices[0].text for c in greedy(client, prompt="Hello there", max_tokens=5, echo=True,
                                                         stream=True) if c.choices)
    assert streamed == "Hello there" + plain

    expect_error(openai.BadRequestError, lambda: greedy(client, prompt="x", suffix="y"), 400, "suffix")


def test_echo_with_logprobs_reports_the_prompt_tokens_like_transformers(client, ckpt) -> None:  # noqa: ANN001
    prompt = [5, 17, 99, 3, 250, 41]
    r = greedy(client, prompt=prompt, max_tokens=3, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(ckpt.hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 2
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [c for c in greedy(client, prompt=prompt, max_tokens=3, echo=True, logprobs=2, stream=True) if c.choices]
    slp = streamed[0].choices[0].logprobs
    assert slp.token_logprobs[0] is None and len(slp.tokens) >= len(prompt)
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == len(prompt) + 3
    # Twice: the prompt logprobs do not depend on a cached prefix.
    again = greedy(client, prompt=prompt, max_tokens=3, echo=True, logprobs=2).choices[0].logprobs
    assert again.token_logprobs == lp.token_logprobs


def test_logit_bias_forces_and_bans_tokens_and_is_validated(client, mesh) -> None:  # noqa: ANN001
    r = greedy(client, prompt=[1, 2, 3], max_tokens=5, logit_bias={"42": 100}, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(isinstance(x, float) for x in lp.token_logprobs)
    forced = httpx.post(f"{mesh.url}/detokenize", json={"tokens": [42] * 5}, timeout=10).json()["prompt"]
    assert r.choices[0].text == forced
    first = greedy(client, prompt=[1, 2, 3], max_tokens=1).choices[0].text
    top = httpx.post(f"{mesh.url}/tokenize", json={"prompt": first, "add_special_tokens": False}, timeout=10).json()
    banned = greedy(client, prompt=[1, 2, 3], max_tokens=1, logit_bias={str(top["tokens"][0]): -100}).choices[0].text
    assert banned != first
    for bad in ({"abc": 1}, {"100000": 1}, {"5": 101}):
        expect_error(openai.BadRequestError, lambda: greedy(client, prompt="x", max_tokens=2, logit_bias=bad), 400,
                     "logit_bias")


def test_vllm_extras_reach_the_engine(client, mesh) -> None:  # noqa: ANN001
    r = greedy(client, prompt=[1, 2, 3], max_tokens=8, logit_bias={"42": 100}, extra_body={"stop_token_ids": [42]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    allowed = [7, 9, 11]
    r = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    ids = client._client.post(f"{mesh.url}/tokenize", json={"prompt": r.choices[0].text,  # noqa: SLF001
                                                            "add_special_tokens": False}).json()["tokens"]
    assert ids and set(ids) <= set(allowed)
    for field, value in (("stop_token_ids", [10**6]), ("allowed_token_ids", [-1]), ("allowed_token_ids", [])):
        expect_error(openai.BadRequestError,
                     lambda: greedy(client, prompt="x", max_tokens=2, extra_body={field: value}), 400, field)
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt="x", max_tokens=2, extra_body={"top_k": -5}), 400,
                 "top_k")
    expect_error(openai.BadRequestError, lambda: greedy(client, prompt="x", max_tokens=2, extra_body={"min_p": 2}), 400,
                 "min_p")


def test_small_endpoints(client, mesh) -> None:  # noqa: ANN001
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.model_extra["root"] == "tiny"  # never the server's path
    expect_error(openai.NotFoundError, lambda: client.models.retrieve("gpt-4"), 404, "model")
    t = httpx.post(f"{mesh.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, timeout=10).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) and t["max_model_len"] == 512
    d = httpx.post(f"{mesh.url}/detokenize", json={"tokens": t["tokens"]}, timeout=10).json()
    assert "Hello world" in d["prompt"]
    chat = httpx.post(f"{mesh.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10).json()
    assert chat["count"] > 1
    r = httpx.post(f"{mesh.url}/detokenize", json={"tokens": [10**6]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{mesh.url}/version", timeout=10).json()["version"]


def test_continuous_usage_stats_and_strict_types(client, mesh) -> None:  # noqa: ANN001
    chunks = list(greedy(client, prompt="Hello", max_tokens=5, stream=True,
                         stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted == sorted(counted) and counted[-1] == 5 and all(c.usage is not None for c in chunks)
    for body, param in (({"prompt": "x", "stream": "yes"}, "stream"),
                        ({"prompt": "x", "stream_options": {"include_usage": True}}, None)):
        r = httpx.post(f"{mesh.url}/v1/completions", json={"model": "tiny", **body}, timeout=10)
        assert r.status_code == 400, r.text
        if param:
            assert r.json()["error"]["param"] == param
