"""The pooling routes: /v1/embeddings, /v1/rerank (and /rerank), /v1/score for a pooling model, /classify,
/pooling.

Each input is tokenized (the tokenizer service; a cross-encoder's query/document pair with the gateway's own
tokenizer, as a text pair the way vLLM builds it), checked against the context, and sent as one PoolRequest
to the pooling workers' queue group: a list of inputs becomes that many engine requests, in flight together
so the workers batch them, and the answer lists them in input order.
"""
from __future__ import annotations

import asyncio
import base64
import math
import time
import uuid
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse
from opentelemetry import trace

from services.gateway.context import GatewayContext
from services.gateway.errors import APIError, bad_request, unavailable
from services.gateway.overload import admit
from services.gateway.pooling_mode import require_pooling
from services.gateway.pooling_schemas import (MAX_INPUTS, ClassifyRequest, CrossScoreRequest, EmbeddingRequest,
                                              PoolingRequest, RerankRequest)
from services.gateway.prepare import check_model, encode
from shared import bus, subjects
from shared.prompt_check import PromptError, check_token_ids
from shared.protocol import errors as codes
from shared.protocol.pooling import PoolReply, PoolRequest
from shared.protocol.tokenizer import EncodeRequest

POOL_TIMEOUT_S = 120.0


def _inputs(raw: Any) -> list[str | list[int]]:
    """OpenAI's `input` as a list of items, each a string or a token-id list."""
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise bad_request("input must not be empty", param="input", code="empty_input")
    if isinstance(raw[0], int):
        return [list(raw)]
    return list(raw)


async def _tokens(ctx: GatewayContext, items: list[str | list[int]], truncate: int | None,
                  add_special_tokens: bool) -> list[list[int]]:
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", param="input")
    texts = [i for i in items if isinstance(i, str)]
    encoded = iter(await asyncio.gather(*(encode(ctx, EncodeRequest(prompt=t, add_special_tokens=add_special_tokens),
                                                 param="input") for t in texts)))
    out = []
    for item in items:
        ids = next(encoded) if isinstance(item, str) else list(item)
        out.append(_checked(ctx, ids, truncate, "input"))
    return out


def _context(ctx: GatewayContext) -> int:
    """The model's context, or less when the pooling workers were started with a shorter one (their beats say)."""
    workers = [b.max_model_len for b in ctx.metrics.prefill_workers.alive() if b.max_model_len]
    return min([ctx.max_model_len(), *workers])


def _checked(ctx: GatewayContext, ids: list[int], truncate: int | None, param: str) -> list[int]:
    limit = _context(ctx)
    if not ids:
        raise bad_request("an input has no tokens", param=param, code="empty_input")
    try:
        check_token_ids(ids, ctx.vocab_size, param=param)
    except PromptError as e:
        raise bad_request(e.message, param=param, code=e.code) from None
    if truncate is not None:
        keep = limit if truncate == -1 else truncate
        if keep > limit:
            raise bad_request(f"truncate_prompt_tokens {keep} is more than the model's {limit}-token context",
                              param="truncate_prompt_tokens")
        if keep == 0:
            raise bad_request("truncate_prompt_tokens 0 leaves no input", param="truncate_prompt_tokens")
        ids = ids[-keep:]  # vLLM keeps the end of the prompt
    if len(ids) > limit:
        raise bad_request(f"an input has {len(ids)} tokens; the model's context is {limit} tokens (set "
                          "truncate_prompt_tokens to cut it)", param=param, code="context_length_exceeded")
    return ids


async def _pool(ctx: GatewayContext, prompts: list[list[int]], task: str, route: str, **options: Any
                ) -> list[np.ndarray]:
    """One PoolRequest per prompt, all in flight at once; the values in prompt order."""
    model = ctx.config.served_model_name
    rid = uuid.uuid4().hex
    span = ctx.tracer.start_span(f"{task} {model}", kind=trace.SpanKind.SERVER, attributes={
        "gen_ai.operation.name": "embeddings" if task == "embed" else task, "gen_ai.request.model": model,
        "http.route": route, "kvmesh.request_id": rid, "kvmesh.inputs": len(prompts)})
    ctx.begin()
    t0 = time.monotonic()
    try:
        admit(ctx)
        with trace.use_span(span, end_on_exit=False):
            replies = await asyncio.gather(*(_one(ctx, PoolRequest(request_id=f"{rid}-{i}", token_ids=p, task=task,
                                                                   **options))
                                             for i, p in enumerate(prompts)))
    finally:
        span.end()
        ctx.end()
    e2e = time.monotonic() - t0
    m = ctx.metrics
    for p in prompts:
        m.prompt_tokens.labels(m.model).inc(len(p))
        m.request_prompt_tokens.labels(m.model).observe(len(p))
        m.e2e.labels(m.model).observe(e2e)
        m.finished("stop")
    return [np.frombuffer(r.data, dtype="<f4").reshape(r.rows, r.cols) for r in replies]


async def _one(ctx: GatewayContext, req: PoolRequest) -> PoolReply:
    try:
        reply = await bus.request(ctx.nc, ctx.subjects.prefill_pool, req, timeout=POOL_TIMEOUT_S, expect=PoolReply)
    except bus.NoRespondersError:
        raise unavailable("no pooling worker is available", code="no_pooling_worker") from None
    except bus.BusTimeout:
        raise APIError(504, "the pooling worker did not answer in time", code="timeout") from None
    except bus.RemoteError as e:
        if e.code == codes.BAD_REQUEST:
            raise bad_request(e.message, param="input") from None
        if e.code == codes.OVERLOADED:
            raise unavailable(f"pooling worker: {e.message}") from None
        raise APIError(500, f"pooling worker failed: {e.message}", code=e.code) from None
    if reply.error is not None:
        raise APIError(500, reply.error, code="pooling_failed")
    return reply


def _usage(prompts: list[list[int]]) -> dict[str, int]:
    n = sum(len(p) for p in prompts)
    return {"prompt_tokens": n, "total_tokens": n}


def _encoded(values: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode()
    return values.tolist()


async def serve_embeddings(ctx: GatewayContext, body: EmbeddingRequest) -> JSONResponse:
    model = check_model(ctx, body.model)
    spec = require_pooling(ctx, "/v1/embeddings", "embed")
    if body.dimensions is not None and body.dimensions != spec.hidden_size:
        dims = spec.matryoshka_dimensions
        if dims is None:
            raise bad_request(f"the model `{model}` does not support Matryoshka representations: dimensions must be "
                              "left out", param="dimensions", code="dimensions_not_supported")
        if body.dimensions > spec.hidden_size or (dims and body.dimensions not in dims):
            allowed = ", ".join(map(str, dims)) if dims else f"1..{spec.hidden_size}"
            raise bad_request(f"dimensions {body.dimensions} is not one of the model's ({allowed})",
                              param="dimensions")
    prompts = await _tokens(ctx, _inputs(body.input), body.truncate_prompt_tokens, body.add_special_tokens)
    dims = body.dimensions if body.dimensions not in (None, spec.hidden_size) else None
    vectors = await _pool(ctx, prompts, "embed", "/v1/embeddings", normalize=body.normalize, dimensions=dims)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v[0], body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "id": f"embd-{uuid.uuid4().hex}", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(prompts)})


async def serve_pooling(ctx: GatewayContext, body: PoolingRequest) -> JSONResponse:
    model = check_model(ctx, body.model)
    require_pooling(ctx, "/pooling")
    prompts = await _tokens(ctx, _inputs(body.input), body.truncate_prompt_tokens, body.add_special_tokens)
    states = await _pool(ctx, prompts, "token", "/pooling")
    data = [{"object": "pooling", "index": i,
             "data": base64.b64encode(s.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
             else s.tolist()} for i, s in enumerate(states)]
    return JSONResponse({"object": "list", "id": f"pool-{uuid.uuid4().hex}", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(prompts)})


async def serve_classify(ctx: GatewayContext, body: ClassifyRequest) -> JSONResponse:
    model = check_model(ctx, body.model)
    spec = require_pooling(ctx, "/classify", "classify")
    prompts = await _tokens(ctx, _inputs(body.input), body.truncate_prompt_tokens, body.add_special_tokens)
    probs = await _pool(ctx, prompts, "classify", "/classify", activation=body.activation)
    data = []
    for i, p in enumerate(probs):
        row = p[0].tolist()
        data.append({"index": i, "label": spec.id2label[int(np.argmax(p[0]))] if spec.id2label else str(np.argmax(p[0])),
                     "probs": row, "num_classes": len(row)})
    return JSONResponse({"object": "list", "id": f"classify-{uuid.uuid4().hex}", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(prompts)})


async def _pair_tokens(ctx: GatewayContext, pairs: list[tuple[str, str]], truncate: int | None) -> list[list[int]]:
    """A cross-encoder's inputs as vLLM builds them: the tokenizer's text pair (its special tokens and separator),
    or query + document as one text when the checkpoint says so (use_sep_token false)."""
    spec = ctx.config.pooling
    assert spec is not None
    if spec.pair_as_text_pair:
        tok = ctx.tokenizer

        def encode_pairs() -> list[list[int]]:
            return [list(tok(text=q, text_pair=d)["input_ids"]) for q, d in pairs]

        ids = await asyncio.to_thread(encode_pairs)
    else:
        ids = await asyncio.gather(*(encode(ctx, EncodeRequest(prompt=q + d), param="documents") for q, d in pairs))
    return [_checked(ctx, list(i), truncate, "documents") for i in ids]


async def _cross_scores(ctx: GatewayContext, pairs: list[tuple[str, str]], truncate: int | None, route: str
                        ) -> tuple[list[float], list[list[int]]]:
    """Relevance of each (query, document) pair: the classifier's score (sigmoid of its one logit, as vLLM),
    or for an embedding model the cosine of the two embeddings (a bi-encoder)."""
    spec = ctx.config.pooling
    assert spec is not None
    if spec.task == "classify":
        if spec.num_labels != 1:
            raise bad_request(f"{route} needs a one-label classifier (a reranker); the model has "
                              f"{spec.num_labels} labels: use /classify", param="model")
        prompts = await _pair_tokens(ctx, pairs, truncate)
        out = await _pool(ctx, prompts, "classify", route)
        return [float(v[0, 0]) for v in out], prompts
    firsts = sorted({q for q, _ in pairs})
    seconds = sorted({d for _, d in pairs})
    texts: list[str | list[int]] = [*firsts, *seconds]
    prompts = await _tokens(ctx, texts, truncate, True)
    vecs = await _pool(ctx, prompts, "embed", route, normalize=True)
    table = {t: v[0] for t, v in zip(firsts, vecs)}
    table2 = {t: v[0] for t, v in zip(seconds, vecs[len(firsts):])}
    return [float(np.dot(table[q], table2[d])) for q, d in pairs], prompts


async def serve_rerank(ctx: GatewayContext, body: RerankRequest, route: str) -> JSONResponse:
    model = check_model(ctx, body.model)
    require_pooling(ctx, route)
    docs = body.texts()
    scores, prompts = await _cross_scores(ctx, [(body.query, d) for d in docs], body.truncate_prompt_tokens, route)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[:body.top_n]
    results = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    total = sum(len(p) for p in prompts)
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                         "usage": {"total_tokens": total, "prompt_tokens": total}})


async def serve_cross_score(ctx: GatewayContext, body: CrossScoreRequest) -> JSONResponse:
    model = check_model(ctx, body.model)
    require_pooling(ctx, "/v1/score")
    try:
        pairs = body.pairs()
    except ValueError as e:
        raise bad_request(str(e), param="text_2") from None
    if len(pairs) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} pairs per request", param="text_2")
    scores, prompts = await _cross_scores(ctx, pairs, body.truncate_prompt_tokens, "/v1/score")
    data = [{"index": i, "object": "score", "score": s if math.isfinite(s) else None} for i, s in enumerate(scores)]
    return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                         "model": model, "data": data, "usage": _usage(prompts)})
