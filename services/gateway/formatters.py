"""Deltas -> OpenAI bodies: whole responses and SSE chunks, for completions and chat completions."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.gateway.choice import Delta
from services.gateway.schemas import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                      ChatDelta, ChatLogprobs, ChatMessageOut, ChatTokenLogprob, CompletionChoice,
                                      CompletionLogprobs, CompletionResponse, FunctionCallDelta, FunctionCallOut,
                                      PromptLogprob, PromptLogprobs,
                                      ToolCallDelta, ToolCallOut, TopLogprob, Usage, dump)
from services.gateway.reasoning import ReasoningPlan, ReasoningStream
from services.gateway.token_bytes import TextOffsets, TokenBytes
from services.gateway.tools import ParsedCall, ToolPlan, ToolStream
from shared.protocol.generate import TokenLogprob


def usage(prompt: int, completion: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


@dataclass
class _Acc:
    """One choice's deltas, accumulated for a non-streamed answer."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matched_stop: str | int | None = None


class Formatter:
    """Base: ids, timestamps and the accumulation shared by both endpoints."""

    prefix = "cmpl"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model: str, request_id: str, n: int, logprobs: int | None,
                 echo: list[str] | None = None, per_prompt: int = 1, tools: ToolPlan | None = None,
                 prompts: list[list[int]] | None = None) -> None:
        self.tok, self.model, self.n, self.logprobs = tokenizer, model, n, logprobs
        self.echo, self.per_prompt, self.prompts = echo, per_prompt, prompts
        self._echo_sent = [False] * n
        self._ids_sent: set[int] = set()  # choices whose first chunk went out (return_token_ids)
        self.tools = tools if tools is not None and tools.mode != "none" else None
        self._tool_streams = [ToolStream(self.tools) for _ in range(n)] if self.tools else []
        self.id = f"{self.prefix}-{request_id}"
        self.created = int(time.time())
        self._acc = [_Acc() for _ in range(n)]
        self.token_bytes = TokenBytes(tokenizer)  # logprobs' bytes: a token's own, even mid-character
        self._offsets = [TextOffsets(self.token_bytes) for _ in range(n)]  # completions' text_offset, per choice
        self.reasoning: ReasoningPlan | None = None
        self._reason_streams: list[ReasoningStream] = []
        self.reasoning_tokens = 0
        self._templates: dict[tuple[int, bool], tuple[str, str] | None] = {}  # sse_chunks' fast path

    def reason(self, plan: ReasoningPlan) -> None:
        """Keep a reasoning model's <think> text apart from the answer (reasoning.py)."""
        self.reasoning = plan
        self._reason_streams = [ReasoningStream(plan) for _ in range(self.n)]

    def split_reasoning(self, d: Delta) -> tuple[str, str]:
        """(reasoning, answer) text of one delta; its tokens count as reasoning tokens while a block is open."""
        if self.reasoning is None:
            return "", d.text
        s = self._reason_streams[d.index]
        before = s.in_reasoning
        reasoning, answer = s.feed(d.text, final=bool(d.finish_reason))
        if before or reasoning or s.in_reasoning:
            self.reasoning_tokens += len(d.token_ids)
        return reasoning, answer

    def with_reasoning_tokens(self, u: Usage) -> Usage:
        if self.reasoning is None:
            return u
        return u.model_copy(update={"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}})

    def add(self, d: Delta) -> tuple[str, str]:
        """Accumulate a delta; its (reasoning, answer) text (the whole text is split again at the end)."""
        a = self._acc[d.index]
        a.text += d.text
        a.token_ids.extend(d.token_ids)
        split = self.split_reasoning(d)
        a.logprobs.extend(d.logprobs)
        if d.prompt_logprobs is not None:
            a.prompt_logprobs = d.prompt_logprobs
        if d.finish_reason:
            a.finish_reason, a.stop_reason, a.matched_stop = d.finish_reason, d.stop_reason, d.matched_stop
        return split

    tokens_as_ids = False  # vLLM's return_tokens_as_token_ids
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: shown, with this many alternatives
    return_token_ids = False  # vLLM's return_token_ids: the prompt's and the output's ids in the answer

    def _first_of_choice(self, index: int) -> bool:
        """True once per choice: its first streamed chunk (which carries the prompt's ids)."""
        if index in self._ids_sent:
            return False
        self._ids_sent.add(index)
        return True

    def _prompt_ids(self, index: int) -> list[int]:
        return self.prompts[index // self.per_prompt] if self.prompts else []

    def prompt_entries(self, plps: list[TokenLogprob | None] | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs shape: per prompt token, {token id: {logprob, rank, decoded_token}} for the
        prompt token and the top-n alternatives (n + 1 entries when the prompt token is not among them)."""
        if self.prompt_logprobs is None or plps is None:
            return None
        out: PromptLogprobs = []
        for lp in plps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                      decoded_token=self.token_text(lp.token_id))}
            n = self.prompt_logprobs
            for rank, (t, p) in enumerate(zip(lp.top_ids[:n], lp.top_logprobs[:n]), 1):
                entry.setdefault(str(t), PromptLogprob(logprob=p, rank=rank, decoded_token=self.token_text(t)))
            out.append(entry)
        return out

    def token_text(self, token_id: int) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tok.decode([token_id], skip_special_tokens=False)

    done = "data: [DONE]\n\n"  # what ends the SSE stream

    def sse(self, data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def sse_chunks(self, d: Delta, include_usage: bool) -> list[str]:
        """The SSE events of one delta, encoded. A plain text delta (the common case: no logprobs, ids, tools,
        reasoning, echo or finish) is written into a template of its chunk (made once per choice by the general
        path, so the two agree byte for byte): no response model, dump and JSON encoding per token."""
        if d.text and self._plain(d):
            key = (d.index, include_usage)
            template = self._templates.get(key)
            if template is None:
                template = self._templates[key] = self._template(d.index, include_usage)
            if template is not None:
                head, tail = template
                return [head + json.dumps(d.text, ensure_ascii=False)[1:-1] + tail]
        return [self.sse(c) for c in self.chunks(d, include_usage)]

    def _plain(self, d: Delta) -> bool:
        """A delta whose chunk is the template's with another text (the subclass says which fields it needs)."""
        return False

    def _template(self, index: int, include_usage: bool) -> tuple[str, str] | None:
        """(before, after) the text in choice `index`'s plain chunk, JSON-encoded; None if the text is not found
        exactly once (then the general path serves)."""
        mark = "\u0001kvmesh-text\u0002"
        chunks = self.chunks(Delta(index, text=mark), include_usage)
        if len(chunks) != 1:
            return None
        line = self.sse(chunks[0])
        encoded = json.dumps(mark, ensure_ascii=False)[1:-1]
        if line.count(encoded) != 1:
            return None
        head, _, tail = line.partition(encoded)
        return head, tail

    def start_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, d: Delta, include_usage: bool) -> list[dict[str, Any]]:
        """The SSE events of one delta (one chunk for chat and completions)."""
        return [self.chunk(d, include_usage)]

    def error_chunk(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        raise NotImplementedError

    def final(self, u: Usage) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    prefix = "cmpl"

    def _logprobs(self, index: int, lps: list[TokenLogprob],
                  prompt: list[TokenLogprob | None] | None = None) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogprobs(top_logprobs=[] if self.logprobs else None)
        # echo with logprobs: the prompt's tokens first, the first one without a logprob (vLLM, OpenAI).
        entries: list[tuple[TokenLogprob | None, int | None]] = []
        if prompt is not None:
            ids = self._prompt_ids(index)
            entries += [(lp, tok) for lp, tok in zip(prompt, ids)]
        entries += [(lp, None) for lp in lps]
        for lp, tok in entries:
            token_id = lp.token_id if lp is not None else tok
            out.tokens.append(self.token_text(token_id))
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            out.text_offset.append(self._offsets[index].push(token_id))
            if out.top_logprobs is not None:
                # The engine may compute more alternatives for the prompt (prompt_logprobs asked for more).
                out.top_logprobs.append(None if lp is None else {self.token_text(t): p for t, p in
                                                                 zip(lp.top_ids[:self.logprobs], lp.top_logprobs)})
        return out

    def _echoed(self, index: int) -> str:
        return self.echo[index // self.per_prompt] if self.echo else ""

    def _plain(self, d: Delta) -> bool:
        return (self.logprobs is None and not self.return_token_ids and d.prompt_logprobs is None
                and not (self.echo and not self._echo_sent[d.index]) and d.finish_reason is None
                and d.stop_reason is None and d.matched_stop is None)

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        text, prompt = d.text, None
        if self.echo and not self._echo_sent[d.index]:
            # echo: the prompt's text (and its logprobs) lead the choice's first chunk.
            self._echo_sent[d.index] = True
            text, prompt = self._echoed(d.index) + text, d.prompt_logprobs
        choice = CompletionChoice(index=d.index, text=text, logprobs=self._logprobs(d.index, d.logprobs, prompt),
                                  prompt_logprobs=self.prompt_entries(d.prompt_logprobs),
                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason, matched_stop=d.matched_stop)
        if self.return_token_ids:
            choice.token_ids = list(d.token_ids)
            if self._first_of_choice(d.index):
                choice.prompt_token_ids = self._prompt_ids(d.index)
        body = dump(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice]))
        if not include_usage:
            body.pop("usage")
        return body

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return dump(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=u))

    def final(self, u: Usage) -> dict[str, Any]:
        choices = [
            CompletionChoice(index=i, text=self._echoed(i) + a.text,
                             logprobs=self._logprobs(i, a.logprobs, a.prompt_logprobs if self.echo else None),
                             prompt_logprobs=self.prompt_entries(a.prompt_logprobs),
                             prompt_token_ids=self._prompt_ids(i) if self.return_token_ids else None,
                             token_ids=a.token_ids if self.return_token_ids else None, finish_reason=a.finish_reason, stop_reason=a.stop_reason, matched_stop=a.matched_stop)
            for i, a in enumerate(self._acc)
        ]
        return dump(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=u))


class ChatFormatter(Formatter):
    prefix = "chatcmpl"
    echo_message = ""  # vLLM's chat echo: the final assistant message's text, put before each answer

    def _logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            tops = [TopLogprob(token=self.token_text(i), logprob=p, bytes=list(self.token_bytes.of(i)))
                    for i, p in zip(lp.top_ids, lp.top_logprobs)]
            content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(self.token_bytes.of(lp.token_id)),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], u: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=u)

    def start_chunks(self) -> list[dict[str, Any]]:
        # OpenAI opens every choice with a role-only delta.
        chunks = [dump(self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]))
                  for i in range(self.n)]
        if self.echo_message:  # then the echoed text, as its own chunk per choice (vLLM)
            chunks += [dump(self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=self.echo_message))]))
                       for i in range(self.n)]
        for c in chunks:
            c.pop("prompt_logprobs"), c.pop("prompt_token_ids"), c["choices"][0].pop("token_ids")
        return chunks

    def _plain(self, d: Delta) -> bool:
        return (self.logprobs is None and not self.return_token_ids and d.prompt_logprobs is None
                and self.tools is None and self.reasoning is None and d.finish_reason is None
                and d.stop_reason is None and d.matched_stop is None)

    def chunks(self, d: Delta, include_usage: bool) -> list[dict[str, Any]]:
        # No chunk that carries nothing: a delta whose text a tool stream holds back sends nothing (vLLM).
        body = self.chunk(d, include_usage)
        choice = body["choices"][0]
        empty = (not choice["delta"].get("content") and not choice["delta"].get("tool_calls")
                 and not choice["delta"].get("reasoning_content") and body.get("prompt_logprobs") is None
                 and not choice.get("token_ids") and body.get("prompt_token_ids") is None
                 and not choice.get("finish_reason") and not choice.get("logprobs"))
        return [] if empty else [body]

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        finish = d.finish_reason
        reasoning, text = self.split_reasoning(d)  # tool calls are looked for only in the answer
        if self.tools is None:
            delta = ChatDelta(content=text, reasoning_content=reasoning or None) \
                if text or reasoning or not d.finish_reason else ChatDelta()
        else:
            # Calls stream as they form: the first delta of each carries index, id, type and name, later ones
            # argument fragments whose concatenation is the final arguments (services/gateway/call_scanner.py).
            stream = self._tool_streams[d.index]
            content, calls = stream.feed_calls(text)
            if d.finish_reason:
                content += stream.finish_calls()
                finish = self._finish_reason(d.finish_reason, stream.streamed)
            deltas = [ToolCallDelta(index=c.index, id=stream.ids[c.index], type="function",
                                    function=FunctionCallDelta(name=c.name, arguments=c.arguments))
                      if c.name is not None else
                      ToolCallDelta(index=c.index, function=FunctionCallDelta(arguments=c.arguments))
                      for c in calls]
            delta = ChatDelta(content=content or None, reasoning_content=reasoning or None, tool_calls=deltas or None)
        choice = ChatChunkChoice(index=d.index, delta=delta, logprobs=self._logprobs(d.logprobs), finish_reason=finish,
                                 stop_reason=d.stop_reason, matched_stop=d.matched_stop)
        chunk = self._chunk([choice])
        chunk.prompt_logprobs = self.prompt_entries(d.prompt_logprobs)
        if self.return_token_ids:
            choice.token_ids = list(d.token_ids)
            if self._first_of_choice(d.index):
                chunk.prompt_token_ids = self._prompt_ids(d.index)
        body = dump(chunk)
        if not include_usage:
            body.pop("usage")
        for key in ("prompt_logprobs", "prompt_token_ids"):
            if body[key] is None:
                body.pop(key)
        if body["choices"][0]["token_ids"] is None:
            body["choices"][0].pop("token_ids")
        return body

    def _finish_reason(self, reason: str, calls: list) -> str:
        # OpenAI: "tool_calls" when the model chose to call; a forced named function ends with "stop".
        return "tool_calls" if calls and self.tools is not None and self.tools.mode != "named" and reason == "stop" else reason

    def _message(self, a: _Acc) -> tuple[ChatMessageOut, str | None]:
        reasoning, text = self.reasoning.split(a.text) if self.reasoning is not None else (None, a.text)
        if self.tools is None:
            return ChatMessageOut(content=text, reasoning_content=reasoning), a.finish_reason
        content, calls = self.tools.parse(text)
        out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
        reason = self._finish_reason(a.finish_reason, calls) if a.finish_reason else None
        return ChatMessageOut(content=content, reasoning_content=reasoning, tool_calls=out), reason

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        body = dump(self._chunk([], self.with_reasoning_tokens(u)))
        body.pop("prompt_logprobs"), body.pop("prompt_token_ids")
        return body

    def final(self, u: Usage) -> dict[str, Any]:
        choices = []
        for i, a in enumerate(self._acc):
            message, reason = self._message(a)
            if self.echo_message:
                message.content = self.echo_message + (message.content or "")
            choices.append(ChatChoice(index=i, message=message, logprobs=self._logprobs(a.logprobs), finish_reason=reason,
                                      stop_reason=a.stop_reason, matched_stop=a.matched_stop,
                                      token_ids=a.token_ids if self.return_token_ids else None))
        return dump(ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=self.with_reasoning_tokens(u),
                                          prompt_logprobs=self.prompt_entries(self._acc[0].prompt_logprobs),
                                          prompt_token_ids=self._prompt_ids(0) if self.return_token_ids else None))
