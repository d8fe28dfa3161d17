"""SGLang's native POST /generate: `text` or `input_ids` (one or a batch), `sampling_params` in SGLang's
spelling, `stream`, `return_logprob`. The body becomes a completions request (the one path to the engine,
services/gateway/sampling.py) and the answer is written in SGLang's shape: per choice `text`, `output_ids`
and `meta_info` (id, finish_reason as {"type", "matched" | "length"}, prompt/completion/cached tokens, and
the logprobs asked for). A batch (or n > 1) answers a list.

A stream sends increments, as SGLang's --incremental-streaming-output: each event's `text`, `output_ids` and
output logprobs are what is new since the choice's previous event, the prompt's logprobs come once (in the
choice's first event), and meta_info's counts are running totals; then `data: [DONE]`. Resending the whole
output in every event (SGLang's default) costs the gateway CPU and bytes quadratic in the answer's length, for
one request.
"""
from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from services.gateway.choice import Delta
from services.gateway.formatters import Formatter
from services.gateway.schemas import MAX_N, CompletionRequest, Usage, _Request
from shared.protocol.generate import TokenLogprob
from shared.sampling_params import MAX_TOP_LOGPROBS

# SGLang's sampling_params name -> the completions field it becomes (same name where not listed).
RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}


class GenerateSampling(_Request):
    max_new_tokens: int = Field(128, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(None, ge=0, lt=2**63)


class NativeGenerateRequest(_Request):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: StrictBool = False
    return_logprob: StrictBool = False
    top_logprobs_num: StrictInt = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    # Prompt logprobs from this prompt position on (-1: none), with return_logprob.
    logprob_start_len: StrictInt = Field(-1, ge=-1)
    return_text_in_logprobs: StrictBool = False

    @model_validator(mode="after")
    def _one_input(self) -> NativeGenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def completion(self) -> CompletionRequest:
        """The same request as a completions body; a problem is a 400 naming the SGLang field."""
        s = self.sampling_params
        fields = s.model_dump(exclude_unset=True)
        body: dict[str, Any] = {RENAMED.get(k, k): v for k, v in fields.items()}
        body.setdefault("max_tokens", s.max_new_tokens)
        body.setdefault("top_k", s.top_k)
        body.update(prompt=self.text if self.text is not None else self.input_ids, stream=self.stream)
        if self.return_logprob:
            body["logprobs"] = self.top_logprobs_num
            if self.logprob_start_len >= 0:
                body["prompt_logprobs"] = self.top_logprobs_num
        back = {v: k for k, v in RENAMED.items()}
        try:
            return CompletionRequest.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *_sglang_loc(err["loc"], back))}
                                          for err in e.errors()]) from None


def _sglang_loc(loc: tuple, back: dict[str, str]) -> tuple:
    if loc and loc[0] in ("prompt",):
        return ("text",)
    if loc and loc[0] in ("logprobs", "prompt_logprobs"):
        return ("top_logprobs_num",)
    return ("sampling_params", back.get(str(loc[0]), loc[0]), *loc[1:]) if loc else loc


class GenerateFormatter(Formatter):
    """SGLang's /generate answer; filled by the same deltas as the OpenAI formatters."""

    prefix = "gen"

    def __init__(self, *args: Any, request: NativeGenerateRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.request = request  # batching and logprob options
        self._ids: list[list[int]] = [[] for _ in range(self.n)]

    def add(self, d: Delta) -> tuple[str, str]:
        self._ids[d.index].extend(d.token_ids)
        return super().add(d)

    def _item(self, i: int, cached: int | None, delta: Delta | None = None) -> dict[str, Any]:
        """Choice i's answer; with `delta`, its streamed event (the delta's text, ids and logprobs)."""
        a = self._acc[i]
        prompt = self._prompt_ids(i)
        if delta is not None:
            text, ids, logprobs = delta.text, list(delta.token_ids), delta.logprobs
            prompt_lps = delta.prompt_logprobs  # on the choice's first delta only
        else:
            text, ids, logprobs, prompt_lps = a.text, list(self._ids[i]), a.logprobs, a.prompt_logprobs
        finish = None
        if a.finish_reason == "length":
            finish = {"type": "length", "length": len(self._ids[i])}
        elif a.finish_reason is not None:
            finish = {"type": a.finish_reason, "matched": a.matched_stop}
        meta: dict[str, Any] = {"id": f"{self.id}-{i}", "finish_reason": finish, "prompt_tokens": len(prompt),
                                "completion_tokens": len(self._ids[i])}
        if cached is not None:
            meta["cached_tokens"] = cached
        r = self.request
        if r.return_logprob:
            meta["output_token_logprobs"] = [self._triple(lp.logprob, lp.token_id) for lp in logprobs]
            meta["output_top_logprobs"] = [[self._triple(p, t) for t, p in zip(lp.top_ids, lp.top_logprobs)]
                                           for lp in logprobs]
            if r.logprob_start_len >= 0 and (delta is None or prompt_lps is not None):
                start = r.logprob_start_len
                plps: list[TokenLogprob | None] = list(prompt_lps or [])
                meta["input_token_logprobs"] = [self._triple(lp.logprob if lp else None, tok)
                                                for lp, tok in zip(plps[start:], prompt[start:])]
                meta["input_top_logprobs"] = [None if lp is None else
                                              [self._triple(p, t) for t, p in zip(lp.top_ids, lp.top_logprobs)]
                                              for lp in plps[start:]]
        return {"text": text, "output_ids": ids, "meta_info": meta, "index": i}

    def _triple(self, logprob: float | None, token_id: int) -> list[Any]:
        """SGLang's (logprob, token id, text) entry; the text only with return_text_in_logprobs."""
        text = self.token_text(token_id) if self.request.return_text_in_logprobs else None
        return [logprob, token_id, text]

    def chunk(self, d: Delta, include_usage: bool) -> dict[str, Any]:
        # Increments (the module's docstring). The request's cached tokens are known to the whole answer only (a
        # formatter sees deltas), so stream events leave them out.
        self.add(d)
        return self._item(d.index, None, d)

    def final(self, u: Usage) -> Any:
        cached = (u.prompt_tokens_details or {}).get("cached_tokens", 0)
        items = [self._item(i, cached) for i in range(self.n)]
        for item in items:
            item.pop("index")
        single = not self.request.batched and self.n == 1
        return items[0] if single else items
