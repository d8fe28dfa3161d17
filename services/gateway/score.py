"""SGLang's /v1/score: the probability of each label token right after query + item, for a batch of items.

Done with the engine's prompt logprobs, which are exact (fp32 log-softmax of the raw logits, no sampling
processor in between): for each item and label, the prompt query + item + [label] with prompt_logprobs,
and the last position's logprob is the label's. A request per (item, label) pair, so any label id
works (the top-k path would only see labels among the 20 likeliest); prompt-logprob requests bypass
the prefix cache (it has no logits to give), so each pair computes its whole prompt.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from opentelemetry import trace
from pydantic import Field, StrictBool, StrictInt, model_validator

from services.gateway.overload import admit, check_cost
from services.gateway.context import GatewayContext
from services.gateway.errors import bad_request
from services.gateway.generation import Generation
from services.gateway.prepare import Prepared, check_model, encode
from services.gateway.schemas import _Request
from shared.prompt_check import PromptError, check_prompt, check_token_ids
from shared.sampling_params import SamplingParams
from shared.protocol.tokenizer import EncodeRequest

MAX_PAIRS = 256  # items x labels in one request


class ScoreRequest(_Request):
    model: str | None = None
    query: str | list[StrictInt]
    items: list[str] | list[list[StrictInt]] = Field(min_length=1)
    label_token_ids: list[StrictInt] = Field(min_length=1)
    apply_softmax: StrictBool = False  # normalize over the labels (else each label's own probability)
    item_first: StrictBool = False  # item + query instead of query + item

    @model_validator(mode="after")
    def _same_kind(self) -> ScoreRequest:
        if isinstance(self.query, str) != isinstance(self.items[0], str):
            raise ValueError("query and items must both be text or both be token ids")
        return self


async def serve_score(ctx: GatewayContext, body: ScoreRequest) -> JSONResponse:
    model = check_model(ctx, body.model)
    labels = body.label_token_ids
    if len(body.items) * len(labels) > MAX_PAIRS:
        raise bad_request(f"at most {MAX_PAIRS} items x label_token_ids per request", param="items")
    try:
        check_token_ids(labels, ctx.vocab_size, "label_token_ids", "label_token_ids")
    except PromptError as e:
        raise bad_request(e.message, param="label_token_ids", code=e.code) from None
    if isinstance(body.query, str):
        # Text is joined before tokenizing, as SGLang does (a token boundary may fall across the join).
        texts = [item + body.query if body.item_first else body.query + item for item in body.items]  # type: ignore[operator]
        prompts = [await encode(ctx, EncodeRequest(prompt=t)) for t in texts]
    else:
        prompts = [list(item) + list(body.query) if body.item_first else list(body.query) + list(item)
                   for item in body.items]  # type: ignore[arg-type]
    limit = ctx.max_model_len()
    for ids in prompts:
        try:
            check_prompt(ids, ctx.vocab_size)
        except PromptError as e:
            raise bad_request(e.message, param="items" if e.param == "prompt" else e.param, code=e.code) from None
        if len(ids) + 2 > limit:  # the label, and the one token generated after it
            raise bad_request(f"query + item of {len(ids)} tokens leaves no room in the {limit}-token context",
                              param="items", code="context_length_exceeded")
    pairs = [ids + [label] for ids in prompts for label in labels]
    # Each pair is a whole prefill with logprobs at every prompt position (the prefix cache has no logits to give).
    check_cost(ctx, pairs, 1, 1, param="items")
    prepared = Prepared(request_id=uuid.uuid4().hex, prompts=[ids + [label] for ids in prompts for label in labels],
                        samplings=[SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                                  lora_name=model if ctx.loras.resolve(model) else None)], priority=0, stops=[],
                        logprobs=None, max_tokens=1, model=model)
    span = ctx.tracer.start_span(f"score {model}", kind=trace.SpanKind.SERVER, attributes={
        "gen_ai.operation.name": "score", "gen_ai.request.model": model, "http.route": "/v1/score",
        "kvmesh.request_id": prepared.request_id})
    ctx.begin()
    gen = Generation(ctx, prepared, span, time.monotonic())
    logprobs: dict[int, float] = {}
    try:
        admit(ctx)
        await gen.open()
        async for d in gen.deltas():
            if d.prompt_logprobs:
                last = d.prompt_logprobs[-1]
                if last is not None:
                    logprobs[d.index] = last.logprob
    except BaseException:
        gen.abort("error")
        raise
    finally:
        await gen.close()
        gen.finish()
        span.end()
        ctx.end()
    if len(logprobs) != len(prepared.prompts):
        raise RuntimeError(f"prompt logprobs came back for {len(logprobs)} of {len(prepared.prompts)} prompts")
    scores = []
    for i in range(len(prompts)):
        row = [logprobs[i * len(labels) + j] for j in range(len(labels))]
        if body.apply_softmax:
            top = max(row)
            exp = [math.exp(x - top) for x in row]
            scores.append([e / sum(exp) for e in exp])
        else:
            scores.append([math.exp(x) for x in row])
    prompt_tokens = sum(len(p) for p in prepared.prompts)
    out: dict[str, Any] = {"object": "scoring", "model": model, "scores": scores,
                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}
    return JSONResponse(out)
