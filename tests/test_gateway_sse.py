"""The gateway's SSE encoding: the per-token fast path (a chunk template filled with the text) writes exactly
what the general path (response model, dump, JSON) writes, for every delta it takes, and leaves the others to it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from loadtest.sim_model import build_sim_model
from services.gateway.choice import Delta
from services.gateway.formatters import ChatFormatter, CompletionFormatter, Formatter
from shared.protocol.generate import TokenLogprob

TEXTS = ["hello", " world", 'a "quoted" \\ back\\slash', "line\nbreak\ttab", "é ü 漢字", "emoji 🙂",
         "\u2028 separators \u2029", "\x01\x02 control", "</script>", "{}[]:,", "\u0001kvmesh-text\u0002"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(build_sim_model(Path(tmp_path_factory.mktemp("sim")) / "model"))


def _general(fmt: Formatter, d: Delta, include_usage: bool) -> list[str]:
    return [fmt.sse(c) for c in fmt.chunks(d, include_usage)]


def _pair(cls: type[Formatter], tokenizer, rid: str, n: int, logprobs: int | None) -> tuple[Formatter, Formatter]:  # noqa: ANN001
    """Two formatters of one request: the same `created` second even when a second boundary falls between them."""
    fast, general = cls(tokenizer, "sim", rid, n, logprobs), cls(tokenizer, "sim", rid, n, logprobs)
    general.created = fast.created
    return fast, general


@pytest.mark.parametrize("cls", [CompletionFormatter, ChatFormatter])
@pytest.mark.parametrize("include_usage", [False, True])
def test_fast_path_writes_what_the_general_path_writes(tokenizer, cls: type[Formatter], include_usage: bool) -> None:  # noqa: ANN001
    fast, general = _pair(cls, tokenizer, "r1", 2, None)
    for i, text in enumerate(TEXTS):
        d = Delta(i % 2, text=text, token_ids=[10 + i])
        got = fast.sse_chunks(d, include_usage)
        assert got == _general(general, d, include_usage), text
        body = json.loads(got[0].removeprefix("data: "))
        assert body["choices"][0]["index"] == i % 2
    assert set(fast._templates) == {(0, include_usage), (1, include_usage)}  # the fast path served them


@pytest.mark.parametrize("cls", [CompletionFormatter, ChatFormatter])
def test_other_deltas_take_the_general_path(tokenizer, cls: type[Formatter]) -> None:  # noqa: ANN001
    deltas = [Delta(0, text="end", token_ids=[5], finish_reason="stop", stop_reason="x", matched_stop="x"),
              Delta(0, text="", token_ids=[6]),  # held-back text: chat sends nothing, completions an empty text
              Delta(0, text="", finish_reason="length")]
    for d in deltas:
        fast, general = _pair(cls, tokenizer, "r2", 1, None)
        assert fast.sse_chunks(d, True) == _general(general, d, True)
        assert not fast._templates
    # Logprobs asked for: every delta is encoded in full (the template has no room for them).
    lp = [TokenLogprob(token_id=7, logprob=-0.5, rank=1, top_ids=[7], top_logprobs=[-0.5])]
    fast, general = _pair(cls, tokenizer, "r3", 1, 1)
    d = Delta(0, text="x", token_ids=[7], logprobs=lp)
    assert fast.sse_chunks(d, False) == _general(general, d, False) and not fast._templates
    assert "logprobs" in json.loads(fast.sse_chunks(d, False)[0].removeprefix("data: "))["choices"][0]
