"""vLLM's and SGLang's request extras (issue 23, round two): prompt_logprobs, include_stop_str_in_output /
no_stop_trim, skip_special_tokens and spaces_between_special_tokens, bad_words, truncate_prompt_tokens,
stop_regex, cache_salt and a per-request chat_template, each through the real openai client (extra_body)
against one real mesh (nats-server, tokenizer service, decode worker), streamed and not, plus an invalid
value per field answered by a 400 naming it. Prompt logprobs are checked against transformers."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.checkpoints import build_checkpoint
from tests.gateway_harness import one_decoder_mesh, openai_client
from tests.test_gateway_api import expect_error

PROMPT = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):  # noqa: ANN001, ANN201
    return build_checkpoint("llama", tmp_path_factory.mktemp("extras") / "llama").path


@pytest.fixture(scope="module")
def tok(model_dir):  # noqa: ANN001, ANN201
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def mesh(model_dir, tmp_path_factory):  # noqa: ANN001, ANN201
    with one_decoder_mesh(tmp_path_factory, model_dir=model_dir, trust_request_chat_template=True) as m:
        yield m


@pytest.fixture(scope="module")
def client(mesh):  # noqa: ANN001, ANN201
    return openai_client(mesh)


def complete(client, stream=False, **kw):  # noqa: ANN001, ANN003, ANN201
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("prompt", "max_tokens", "temperature", "stop", "logprobs",
                                                         "echo", "seed", "n", "stream_options", "logit_bias")}
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model="tiny", stream=stream, extra_body=extra or None, **kw)


def chat(client, stream=False, **kw):  # noqa: ANN001, ANN003, ANN201
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("messages", "max_tokens", "temperature", "stop", "logprobs",
                                                         "top_logprobs", "seed", "n", "stream_options")}
    kw.setdefault("messages", [{"role": "user", "content": PROMPT}])
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model="tiny", stream=stream, extra_body=extra or None, **kw)


def streamed(chunks) -> tuple[str, list]:  # noqa: ANN001
    chunks = list(chunks)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def output_ids(choice) -> list[int]:  # noqa: ANN001
    """A completion choice's token ids, from logprobs=0 with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


# ------------------------------------------------------------------------------------ prompt_logprobs


def test_prompt_logprobs_match_transformers(client, tok, model_dir) -> None:  # noqa: ANN001
    ids = tok.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    out = complete(client, prompt_logprobs=3, max_tokens=2)
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry = plp[p]
        assert str(ids[p]) in entry and len(entry) in (3, 4)  # the prompt token, plus the top 3
        want = ref[p - 1, ids[p]].item()
        got = entry[str(ids[p])]
        assert abs(got["logprob"] - want) < 1e-3
        assert got["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert got["decoded_token"] == tok.decode([ids[p]])
        top = ref[p - 1].topk(3)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-3 and entry[str(t)]["rank"] == r
    # Streamed: the choice's first chunk carries the same list.
    _, chunks = streamed(complete(client, stream=True, prompt_logprobs=3, max_tokens=2))
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert firsts[0] == plp and all(f is None for f in firsts[1:])
    # 0: the prompt token alone; ids as "token_id:<id>" with return_tokens_as_token_ids.
    zero = complete(client, prompt_logprobs=0, max_tokens=1, return_tokens_as_token_ids=True)
    zplp = zero.choices[0].model_extra["prompt_logprobs"]
    assert [list(e) for e in zplp[1:]] == [[str(t)] for t in ids[1:]]
    assert zplp[1][str(ids[1])]["decoded_token"] == f"token_id:{ids[1]}"


def test_prompt_logprobs_in_chat(client) -> None:  # noqa: ANN001
    out = chat(client, prompt_logprobs=1, max_tokens=2)
    plp = out.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out.usage.prompt_tokens and all(1 <= len(e) <= 2 for e in plp[1:])
    _, chunks = streamed(chat(client, stream=True, prompt_logprobs=1, max_tokens=2))
    got = [c.model_extra.get("prompt_logprobs") for c in chunks]
    assert [g for g in got if g is not None] == [plp]
    # Without the field no chunk and no response carries it.
    assert chat(client, max_tokens=1).model_extra.get("prompt_logprobs") is None


@pytest.mark.parametrize("value", [21, -1, "3", True])
def test_prompt_logprobs_invalid(client, value) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, prompt_logprobs=value), 400, "prompt_logprobs")
    expect_error(openai.BadRequestError, lambda: chat(client, prompt_logprobs=value), 400, "prompt_logprobs")


# ---------------------------------------------------------------- include_stop_str_in_output, no_stop_trim


def test_include_stop_str_in_output(client) -> None:  # noqa: ANN001
    base = complete(client, max_tokens=16).choices[0].text
    assert len(base) > 6
    stop = base[3:6]
    cut = base[: base.index(stop)]
    for stream in (False, True):
        for extra, want in (({}, cut), ({"include_stop_str_in_output": True}, cut + stop),
                            ({"no_stop_trim": True}, cut + stop)):
            out = complete(client, stream=stream, max_tokens=16, stop=[stop], **extra)
            text = streamed(out)[0] if stream else out.choices[0].text
            assert text == want, (stream, extra)
    # A stop token id: its text is left out unless asked for.
    first = complete(client, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True).choices[0]
    ids = output_ids(first)
    stop_id = ids[2]
    k = ids.index(stop_id)
    for include in (False, True):
        out = complete(client, max_tokens=8, stop_token_ids=[stop_id], include_stop_str_in_output=include,
                       logprobs=0, return_tokens_as_token_ids=True).choices[0]
        assert output_ids(out) == ids[: k + 1] and out.finish_reason == "stop"
        want = complete(client, prompt=PROMPT, max_tokens=k + 1).choices[0].text if include else \
            complete(client, max_tokens=k).choices[0].text if k else ""
        assert out.text == want


def test_include_stop_str_invalid(client) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, include_stop_str_in_output="yes"), 400,
                 "include_stop_str_in_output")
    expect_error(openai.BadRequestError, lambda: chat(client, no_stop_trim=1), 400, "no_stop_trim")


# ------------------------------------------------------- skip_special_tokens, spaces_between_special_tokens


def test_special_tokens_in_output(client, tok) -> None:  # noqa: ANN001
    eos, im_end = tok.convert_tokens_to_ids("<|end_of_text|>"), tok.convert_tokens_to_ids("<|im_end|>")
    word = tok.encode(" fox", add_special_tokens=False)[0]
    # A seeded draw among a special token, another special token and a word: the mix is fixed by the seed.
    kw = dict(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[eos, im_end, word],
              logprobs=0, return_tokens_as_token_ids=True)
    skipped = complete(client, **kw).choices[0]
    ids = output_ids(skipped)
    assert {eos, im_end} & set(ids) and word in ids, ids
    assert skipped.text == tok.decode(ids, skip_special_tokens=True) and "<|" not in skipped.text
    kept = tok.decode(ids, skip_special_tokens=False)
    assert "<|" in kept
    for spaces in (True, False):  # a byte-level decoder puts nothing between tokens: both read the same
        out = complete(client, skip_special_tokens=False, spaces_between_special_tokens=spaces, **kw).choices[0]
        assert output_ids(out) == ids and out.text == kept
        text, _ = streamed(complete(client, stream=True, skip_special_tokens=False,
                                    spaces_between_special_tokens=spaces, **kw))
        assert text == kept
    text, _ = streamed(chat(client, stream=True, skip_special_tokens=False, max_tokens=10, temperature=1.0, seed=3,
                            ignore_eos=True, allowed_token_ids=[eos, im_end, word]))
    assert "<|" in text


def test_spaces_between_special_tokens_where_the_decoder_writes_spaces() -> None:
    """A tokenizer without a decoder joins tokens with spaces: spaces_between_special_tokens=false writes a
    special token that follows another bare, as vLLM does; true keeps the decoder's text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from services.gateway.special_tokens import added_tokens, output_detokenizer
    from shared.sampling_params import SamplingParams

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s1>", "<s2>"])
    t = PreTrainedTokenizerFast(tokenizer_object=raw)
    s1, s2 = t.convert_tokens_to_ids(["<s1>", "<s2>"])
    ids = [0, s1, s2, 1, s2]
    assert t.decode(ids, skip_special_tokens=False) == "a <s1> <s2> b <s2>"

    def text(**kw) -> str:  # noqa: ANN003
        d = output_detokenizer(t, [0], SamplingParams(**kw), added_tokens(t))
        return "".join(d.push([i]) for i in ids) + d.flush()

    assert text(skip_special_tokens=False) == " a <s1> <s2> b <s2>"  # after the prompt's "a": a space first
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == " a <s1><s2> b <s2>"
    assert text() == text(spaces_between_special_tokens=False) == " a b"


def test_special_tokens_invalid(client) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, skip_special_tokens="no"), 400, "skip_special_tokens")
    expect_error(openai.BadRequestError, lambda: chat(client, spaces_between_special_tokens=0), 400,
                 "spaces_between_special_tokens")


# ------------------------------------------------------------------------------------------ bad_words


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_bad_words(client, tok) -> None:  # noqa: ANN001
    base = complete(client, max_tokens=16, logprobs=0, return_tokens_as_token_ids=True).choices[0]
    ids = output_ids(base)
    words = [w for w in base.text.split() if len(w) > 1]
    assert words, base.text
    word = words[0]
    banned = [tok.encode(v, add_special_tokens=False) for v in (word, " " + word)]
    assert any(_contains(ids, b) for b in banned)  # the greedy output writes it
    for stream in (False, True):
        out = complete(client, stream=stream, max_tokens=16, bad_words=[word], logprobs=0,
                       return_tokens_as_token_ids=True)
        if stream:
            got = [int(t.removeprefix("token_id:")) for c in out if c.choices and c.choices[0].logprobs
                   for t in c.choices[0].logprobs.tokens]
        else:
            got = output_ids(out.choices[0])
        assert not any(_contains(got, b) for b in banned), (word, got)
        assert got != ids
    text, _ = streamed(chat(client, stream=True, bad_words=[word], max_tokens=8))
    assert isinstance(text, str)


@pytest.mark.parametrize(("value", "param"), [([""], "bad_words"), (["  "], "bad_words"), ("fox", "bad_words"),
                                              ([3], "bad_words.0")])
def test_bad_words_invalid(client, value, param) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, bad_words=value), 400, param)


# ------------------------------------------------------------------------------------ truncate_prompt_tokens


def test_truncate_prompt_tokens(client, tok) -> None:  # noqa: ANN001
    ids = tok.encode(PROMPT)
    tail = ids[-5:]
    want = complete(client, prompt=tail, max_tokens=6)
    for prompt in (PROMPT, ids):
        out = complete(client, prompt=prompt, max_tokens=6, truncate_prompt_tokens=5)
        assert out.usage.prompt_tokens == 5 and out.choices[0].text == want.choices[0].text
    text, chunks = streamed(complete(client, stream=True, max_tokens=6, truncate_prompt_tokens=5,
                                     stream_options={"include_usage": True}))
    assert text == want.choices[0].text and chunks[-1].usage.prompt_tokens == 5
    out = chat(client, truncate_prompt_tokens=4, max_tokens=2)
    assert out.usage.prompt_tokens == 4
    # Longer than the prompt: nothing to cut. Echo shows what the model saw.
    assert complete(client, truncate_prompt_tokens=500, max_tokens=1).usage.prompt_tokens == len(ids)
    echoed = complete(client, truncate_prompt_tokens=5, max_tokens=1, echo=True).choices[0].text
    assert echoed.startswith(tok.decode(tail))


@pytest.mark.parametrize("value", [0, -2, 10**6, "5"])
def test_truncate_prompt_tokens_invalid(client, value) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, truncate_prompt_tokens=value), 400,
                 "truncate_prompt_tokens")


# ----------------------------------------------------------------------------------------- stop_regex


def test_stop_regex(client) -> None:  # noqa: ANN001
    base = complete(client, max_tokens=16).choices[0].text
    assert len(base) > 8
    piece = base[4:7]
    pattern = re.escape(piece[0]) + "." + re.escape(piece[2])  # matches `piece` (and maybe earlier text)
    m = re.search(pattern, base)
    assert m is not None
    for stream in (False, True):
        out = complete(client, stream=stream, max_tokens=16, stop_regex=pattern)
        if stream:
            text, chunks = streamed(out)
            last = [c for c in chunks if c.choices][-1].choices[0]
        else:
            text, last = out.choices[0].text, out.choices[0]
        assert text == base[: m.start()] and last.finish_reason == "stop"
        assert last.model_extra["matched_stop"] == pattern and last.model_extra["stop_reason"] == pattern
        kept = complete(client, stream=stream, max_tokens=16, stop_regex=[pattern], no_stop_trim=True)
        assert (streamed(kept)[0] if stream else kept.choices[0].text) == base[: m.end()]
    assert chat(client, stop_regex=["\\d{40}"], max_tokens=4).choices[0].finish_reason == "length"


@pytest.mark.parametrize("value", ["(", [".*"], 5])
def test_stop_regex_invalid(client, value) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, stop_regex=value), 400, "stop_regex")


# ------------------------------------------------------------------------------------------ cache_salt


def test_cache_salt_isolates_the_prefix_cache(client) -> None:  # noqa: ANN001
    # Four full blocks of 16 tokens and a tail: a repeat finds the blocks only under the same salt.
    prompt = list(range(300, 370))

    def cached(**kw) -> int:  # noqa: ANN003
        return complete(client, prompt=prompt, max_tokens=1, **kw).usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") == 64
    assert cached(cache_salt="tenant-b") == 0  # another tenant: nothing shared
    assert cached() == 0  # unsalted neither
    assert cached() == 64
    _, chunks = streamed(complete(client, stream=True, prompt=prompt, max_tokens=1, cache_salt="tenant-b",
                                  stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    msgs = [{"role": "user", "content": PROMPT * 3}]
    assert chat(client, messages=msgs, cache_salt="c", max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0
    assert chat(client, messages=msgs, cache_salt="c", max_tokens=1).usage.prompt_tokens_details.cached_tokens > 0
    assert chat(client, messages=msgs, cache_salt="d", max_tokens=1).usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("value", ["", 7, "x" * 257])
def test_cache_salt_invalid(client, value) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, cache_salt=value), 400, "cache_salt")


# ---------------------------------------------------------------------------------------- chat_template


def test_request_chat_template(client, tok, mesh) -> None:  # noqa: ANN001
    template = "{%- for m in messages -%}[{{ m.role | upper }}] {{ m.content }}\n{%- endfor -%}[ASSISTANT] "
    msgs = [{"role": "user", "content": "Say something."}]
    rendered = "[USER] Say something.[ASSISTANT] "  # `{%-` trims the newline before it
    out = chat(client, messages=msgs, chat_template=template, max_tokens=3)
    assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    want = complete(client, prompt=tok.encode(rendered, add_special_tokens=False), max_tokens=3).choices[0].text
    assert out.choices[0].message.content == want
    text, _ = streamed(chat(client, stream=True, messages=msgs, chat_template=template, max_tokens=3))
    assert text == want
    default = chat(client, messages=msgs, max_tokens=3)
    assert default.usage.prompt_tokens != out.usage.prompt_tokens


@pytest.mark.parametrize("value", ["{% for m in messages %}", "", 5])
def test_request_chat_template_invalid(client, value) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: chat(client, chat_template=value), 400, "chat_template")


def test_raw_http_error_shape(mesh) -> None:  # noqa: ANN001
    r = httpx.post(f"{mesh.url}/v1/completions", json={"prompt": "x", "prompt_logprobs": 99}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"


def test_cache_salt_keys_kvstore_blocks_apart(model_dir, tmp_path) -> None:  # noqa: ANN001
    """The kvstore tier: a salted prefix that went to the kvstore is found again under its salt only."""
    from tests.gateway_harness import Mesh

    mesh = Mesh(tmp_path, model_dir)
    try:
        mesh.start_tokenizer()
        store = mesh.start_kvstore()
        d0 = mesh.start_decoder("d0", use_kvstore=True)
        mesh.wait_until(lambda: mesh.gateway.ctx.router.alive())
        client = openai_client(mesh)
        prompt = list(range(100, 170))

        def cached(**kw) -> int:  # noqa: ANN003
            extra = {"cache_salt": kw["salt"]} if kw.get("salt") else None
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached(salt="tenant-a") == 0
        mesh.call(d0.drain(2.0))  # its cache goes to the kvstore
        del mesh.decoders["d0"]
        mesh.start_decoder("d1", use_kvstore=True)
        mesh.wait_until(lambda: [w.worker_id for w in mesh.gateway.ctx.router.alive()] == ["d1"], timeout=5)
        hits = store.tier.stats().hits
        assert cached(salt="tenant-b") == 0 and cached() == 0  # other keys: the kvstore has nothing for them
        assert store.tier.stats().hits == hits
        assert cached(salt="tenant-a") == 64  # four blocks, from the kvstore
        assert store.tier.stats().hits >= hits + 4
    finally:
        mesh.close()


# ------------------------------------------------------------------------------ SGLang's native /generate


def test_sglang_generate(client, mesh, tok) -> None:  # noqa: ANN001
    want = complete(client, max_tokens=6, logprobs=2, return_tokens_as_token_ids=True).choices[0]
    ids = output_ids(want)
    url = f"{mesh.url}/generate"
    sp = {"max_new_tokens": 6, "temperature": 0}
    r = httpx.post(url, json={"text": PROMPT, "sampling_params": sp}, timeout=30).json()
    assert r["text"] == want.text and r["output_ids"] == ids
    meta = r["meta_info"]
    assert meta["prompt_tokens"] == len(tok.encode(PROMPT)) and meta["completion_tokens"] == 6
    assert meta["finish_reason"] == {"type": "length", "length": 6} and "cached_tokens" in meta
    # input_ids, a stop string (matched), logprobs with text.
    stop = want.text[2:5]
    r = httpx.post(url, json={"input_ids": tok.encode(PROMPT), "sampling_params": {**sp, "stop": stop},
                              "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
                              "logprob_start_len": 0}, timeout=30).json()
    assert r["text"] == want.text[: want.text.index(stop)]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    out_lp = r["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in out_lp] == r["output_ids"] and all(e[2] == tok.decode([e[1]]) for e in out_lp)
    assert [e[0] for e in out_lp] == pytest.approx(want.logprobs.token_logprobs[: len(out_lp)], abs=1e-4)
    assert all(len(t) == 2 for t in r["meta_info"]["output_top_logprobs"])
    inp = r["meta_info"]["input_token_logprobs"]
    assert len(inp) == len(tok.encode(PROMPT)) and inp[0][0] is None and inp[1][0] < 0
    # A batch answers a list, in order; n > 1 too.
    r = httpx.post(url, json={"text": [PROMPT, "Hello"], "sampling_params": sp}, timeout=30).json()
    assert isinstance(r, list) and len(r) == 2 and r[0]["text"] == want.text
    r = httpx.post(url, json={"text": PROMPT, "sampling_params": {**sp, "n": 2, "temperature": 1.0,
                                                                   "sampling_seed": 1}}, timeout=30).json()
    assert isinstance(r, list) and len(r) == 2
    # Streamed: every event carries what is new (SGLang's incremental streaming); the last one the finish reason.
    events = []
    with httpx.stream("POST", url, json={"text": PROMPT, "sampling_params": sp, "stream": True}, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert "".join(b["text"] for b in bodies) == want.text
    assert bodies[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert [t for b in bodies for t in b["output_ids"]] == ids


@pytest.mark.parametrize(("body", "param"), [
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"stop_regex": "("}}, "stop_regex"),
    ({"text": "x", "input_ids": [1]}, None),
    ({"text": "x", "top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
])
def test_sglang_generate_invalid(mesh, body, param) -> None:  # noqa: ANN001
    r = httpx.post(f"{mesh.url}/generate", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


# ----------------------------------------------------------------------------------------- beam search


def reference_beams(model, prompt: list[int], width: int, n: int, max_tokens: int, length_penalty: float,
                    eos: int) -> list[tuple[list[int], float]]:  # noqa: ANN001
    """vLLM's beam search over transformers' logits, written out plainly (the oracle)."""
    def score(beam: tuple[list[int], float]) -> float:
        toks, cum = beam
        return cum / ((len(prompt) + len(toks) - (1 if toks and toks[-1] == eos else 0)) ** length_penalty)

    live, done = [([], 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for toks, cum in live:
            with torch.no_grad():
                dist = torch.log_softmax(model(torch.tensor([prompt + toks])).logits[0, -1].float(), -1)
            top = dist.topk(2 * width)
            for v, i in zip(top.values.tolist(), top.indices.tolist()):
                (done if i == eos else grown).append((toks + [i], cum + v))
        live = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:n]


@pytest.mark.parametrize(("n", "best_of", "length_penalty"), [(3, None, 1.0), (2, 4, 0.5)])
def test_beam_search_matches_the_reference(client, tok, model_dir, n, best_of, length_penalty) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    prompt = tok.encode(PROMPT)
    want = reference_beams(model, prompt, best_of or n, n, 4, length_penalty, tok.eos_token_id)
    extra = {"best_of": best_of} if best_of else {}
    out = complete(client, n=n, max_tokens=4, logprobs=0, use_beam_search=True, length_penalty=length_penalty,
                   return_tokens_as_token_ids=True, **extra)
    got = [(output_ids(c), sum(c.logprobs.token_logprobs)) for c in out.choices]
    assert [g[0] for g in got] == [w[0] for w in want]  # the same beams, in score order
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=1e-3)
    assert len({tuple(g[0]) for g in got}) == n  # distinct
    assert [c.text for c in out.choices] == [tok.decode(w[0]) for w in want]
    assert out.usage.completion_tokens == sum(len(w[0]) for w in want)
    # Streamed: the same beams, sent once the search is over; chat too.
    text = {}
    for c in complete(client, stream=True, n=n, max_tokens=4, use_beam_search=True, length_penalty=length_penalty,
                      **extra):
        for ch in c.choices:
            text[ch.index] = text.get(ch.index, "") + ch.text
    assert [text[i] for i in range(n)] == [tok.decode(w[0]) for w in want]
    chat_out = chat(client, n=n, max_tokens=3, use_beam_search=True, **extra)
    assert len({c.message.content for c in chat_out.choices}) == n


@pytest.mark.parametrize(("extra", "param"), [
    ({"best_of": 1, "n": 2, "use_beam_search": True}, "best_of"),
    ({"best_of": 3}, "best_of"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "logit_bias": {"5": 1}}, "logit_bias"),
    ({"use_beam_search": "yes"}, "use_beam_search"),
])
def test_beam_search_invalid(client, extra, param) -> None:  # noqa: ANN001
    expect_error(openai.BadRequestError, lambda: complete(client, **extra), 400, param)


# ------------------------------------------- min_tokens with stop ids, guided_*, add_special_tokens, token ids


def test_min_tokens_holds_back_stop_token_ids(client) -> None:  # noqa: ANN001
    ids = output_ids(complete(client, max_tokens=8, logprobs=0, return_tokens_as_token_ids=True).choices[0])
    stop_id = ids[1]
    early = complete(client, max_tokens=8, stop_token_ids=[stop_id], logprobs=0, return_tokens_as_token_ids=True)
    assert output_ids(early.choices[0])[-1] == stop_id and len(early.choices[0].logprobs.tokens) <= 2
    held = complete(client, max_tokens=8, min_tokens=4, stop_token_ids=[stop_id], logprobs=0,
                    return_tokens_as_token_ids=True).choices[0]
    got = output_ids(held)
    assert stop_id not in got[:4] and len(got) >= 4
    assert held.finish_reason == ("stop" if got[-1] == stop_id else "length")


def test_guided_fields(client) -> None:  # noqa: ANN001
    out = complete(client, guided_choice=["alpha", "beta"], max_tokens=8)
    assert out.choices[0].text in ("alpha", "beta")
    text, _ = streamed(chat(client, stream=True, guided_regex="[0-9]{3}", max_tokens=8))
    assert re.fullmatch("[0-9]{3}", text)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    obj = json.loads(chat(client, guided_json=schema, max_tokens=60).choices[0].message.content)
    assert obj["a"] in ("x", "y")
    expect_error(openai.BadRequestError, lambda: complete(client, guided_choice=[]), 400, "guided_choice")
    expect_error(openai.BadRequestError, lambda: complete(client, guided_regex="a", guided_choice=["a"]), 400,
                 "guided_regex")


def test_add_special_tokens(client, tok) -> None:  # noqa: ANN001
    n = len(tok.encode(PROMPT, add_special_tokens=False))
    assert complete(client, max_tokens=1).usage.prompt_tokens == n + 1  # BOS
    assert complete(client, max_tokens=1, add_special_tokens=False).usage.prompt_tokens == n
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    assert chat(client, max_tokens=1, add_special_tokens=True).usage.prompt_tokens == plain + 1  # BOS on top
    expect_error(openai.BadRequestError, lambda: complete(client, add_special_tokens="no"), 400, "add_special_tokens")


def test_return_token_ids(client, tok) -> None:  # noqa: ANN001
    ids = tok.encode(PROMPT)
    out = complete(client, max_tokens=5, return_token_ids=True, logprobs=0, return_tokens_as_token_ids=True)
    c = out.choices[0].model_extra
    assert c["prompt_token_ids"] == ids and c["token_ids"] == output_ids(out.choices[0])
    chunks = [ch for ch in complete(client, stream=True, max_tokens=5, return_token_ids=True) if ch.choices]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == c["token_ids"]
    r = chat(client, max_tokens=4, return_token_ids=True)
    assert r.model_extra["prompt_token_ids"] and len(r.choices[0].model_extra["token_ids"]) == r.usage.completion_tokens
    chunks = list(chat(client, stream=True, max_tokens=4, return_token_ids=True))
    assert [ch.model_extra.get("prompt_token_ids") for ch in chunks if ch.model_extra.get("prompt_token_ids")] == \
        [r.model_extra["prompt_token_ids"]]
    assert sum(len(ch.choices[0].model_extra.get("token_ids") or []) for ch in chunks if ch.choices) == 4
    expect_error(openai.BadRequestError, lambda: complete(client, return_token_ids=1), 400, "return_token_ids")


def test_sglang_model_info_health_generate_and_vllm_load(mesh, model_dir) -> None:  # noqa: ANN001
    info = httpx.get(f"{mesh.url}/get_model_info", timeout=30).json()
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    received = mesh.decoders["d0"].num_received
    r = httpx.get(f"{mesh.url}/health_generate", timeout=30)
    assert r.status_code == 200 and mesh.decoders["d0"].num_received == received + 1  # a real generation
    assert httpx.post(f"{mesh.url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{mesh.url}/load", timeout=30).json() == {"server_load": 0}


def test_chat_echo(client) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "Well, "}]
    kw = dict(messages=msgs, continue_final_message=True, add_generation_prompt=False, max_tokens=5)
    plain = chat(client, **kw).choices[0].message.content
    assert chat(client, echo=True, **kw).choices[0].message.content == "Well, " + plain
    text, _ = streamed(chat(client, stream=True, echo=True, **kw))
    assert text == "Well, " + plain
    # The final message is the user's: nothing to echo.
    assert chat(client, echo=True, max_tokens=5).choices[0].message.content == chat(client, max_tokens=5).choices[0].message.content
    expect_error(openai.BadRequestError, lambda: chat(client, echo="yes"), 400, "echo")


def test_min_tokens_holds_back_stop_strings(client, tok) -> None:  # noqa: ANN001
    """vLLM looks for stop strings only once the output is longer than min_tokens."""
    base = complete(client, max_tokens=10, logprobs=0, return_tokens_as_token_ids=True).choices[0]
    ids = output_ids(base)
    stop = tok.decode(ids[:1]).strip() or tok.decode(ids[:2])
    assert complete(client, max_tokens=10, stop=[stop]).choices[0].text == base.text[: base.text.index(stop)]
    for stream in (False, True):
        out = complete(client, stream=stream, max_tokens=10, min_tokens=4, stop=[stop])
        text = streamed(out)[0] if stream else out.choices[0].text
        assert text.startswith(tok.decode(ids[:4])), (text, stop)
