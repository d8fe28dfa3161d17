"""The FastAPI app: OpenAI routes, /health and /metrics, over one GatewayContext."""
from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import JSONResponse, Response

from services.gateway.overload import admit_early
from services.gateway.intake import Intake, default_body_limit, default_trusted_hosts
from services.gateway.context import GatewayContext
from services.gateway.endpoint import serve_generation
from services.gateway.errors import bad_request, install_error_handlers
from services.gateway import anthropic_messages
from services.gateway.openai_responses import ResponsesFormatter, ResponsesRequest, to_chat
from services.gateway.health import HealthProbes, check_health
from services.gateway.load_info import get_load, server_info
from services.gateway.lora_routes import install_lora_routes
from services.gateway.score import ScoreRequest, serve_score
from services.gateway import pooling_api
from services.gateway.pooling_schemas import (ClassifyRequest, CrossScoreRequest, EmbeddingRequest, PoolingRequest,
                                              RerankRequest)
from services.gateway.sglang_generate import GenerateFormatter, NativeGenerateRequest
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.sampling import first_message
from services.gateway.prepare import prepare_chat, prepare_completion
from services.gateway.served_models import ServedModel
from services.gateway.tokenize import detokenize_body, kvmesh_version, tokenize_body
from services.gateway.formatters import ChatFormatter, CompletionFormatter
from services.gateway.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList,
                                     TokenizeChatRequest, TokenizeCompletionRequest, dump)


async def _json_object(request: Request) -> dict:
    try:
        raw = await request.json()
    except ValueError:
        raise bad_request("invalid JSON body", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return raw


def _validated(schema, raw: dict):  # noqa: ANN001, ANN202
    try:
        return schema.model_validate(raw)
    except ValidationError as e:  # the same 400 as a route's own body validation
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def register_pooling_routes(app: FastAPI, ctx: GatewayContext) -> None:
    """The pooling model's routes (services/gateway/pooling_api.py); on a generative mesh they answer 400."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> JSONResponse:
        return await pooling_api.serve_embeddings(ctx, body)

    @app.post("/v1/rerank")
    async def rerank_v1(body: RerankRequest) -> JSONResponse:
        return await pooling_api.serve_rerank(ctx, body, "/v1/rerank")

    @app.post("/rerank")
    async def rerank(body: RerankRequest) -> JSONResponse:
        return await pooling_api.serve_rerank(ctx, body, "/rerank")

    @app.post("/score")
    async def score_plain(body: CrossScoreRequest) -> JSONResponse:
        return await pooling_api.serve_cross_score(ctx, body)

    @app.post("/classify")
    async def classify(body: ClassifyRequest) -> JSONResponse:
        return await pooling_api.serve_classify(ctx, body)

    @app.post("/pooling")
    async def pooling(body: PoolingRequest) -> JSONResponse:
        return await pooling_api.serve_pooling(ctx, body)


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="kvmesh gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)

    # Before anything is parsed: the API key, admission (429 past the bound on requests at once), then the body
    # size (413 above the limit).
    app.add_middleware(Intake, api_key=ctx.config.api_key, on_error=ctx.metrics.error, admit=partial(admit_early, ctx),
                       max_body_bytes=lambda: ctx.config.max_body_bytes or default_body_limit(ctx.max_model_len()),
                       trusted_hosts=ctx.config.trusted_hosts or default_trusted_hosts(ctx.config.host))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve_generation(ctx, request, body, "/v1/completions", prepare_completion, CompletionFormatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve_generation(ctx, request, body, "/v1/chat/completions", prepare_chat, ChatFormatter)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        # SGLang's native API: its own body and answer around the completions path.
        raw = await _json_object(request)
        try:
            native = NativeGenerateRequest.model_validate(raw)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        body = native.completion()
        return await serve_generation(ctx, request, body, "/generate", prepare_completion,
                                      partial(GenerateFormatter, request=native))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        # vLLM's SageMaker-style entry point: one route, the body says which API it speaks.
        raw = await _json_object(request)
        if "messages" in raw:
            schema, route, prepare, formatter = ChatCompletionRequest, "/v1/chat/completions", prepare_chat, ChatFormatter
        elif "prompt" in raw:
            schema, route, prepare, formatter = CompletionRequest, "/v1/completions", prepare_completion, CompletionFormatter
        else:
            raise bad_request("/invocations takes a chat completions body (with messages) or a completions body "
                              "(with prompt)", param="messages")
        try:
            body = schema.model_validate(raw)
        except ValidationError as e:  # the same 400 as the API's own route would give
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        return await serve_generation(ctx, request, body, route, prepare, formatter)

    def card(model: ServedModel) -> ModelCard:
        # root is the served name, never the model's path on the server's disk.
        return ModelCard(id=model.name, created=model.created, root=model.name, max_model_len=model.max_model_len())

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        try:
            chat = to_chat(body)
        except ValidationError as e:
            raise bad_request(first_message(e), param="input") from None
        return await serve_generation(ctx, request, chat, "/v1/responses", prepare_chat,
                                      partial(ResponsesFormatter, request=body))

    @app.post("/v1/messages")
    async def messages(body: anthropic_messages.MessagesRequest, request: Request) -> Response:
        try:
            chat = anthropic_messages.to_chat(body)
        except ValidationError as e:
            raise bad_request(first_message(e), param="messages") from None
        return await serve_generation(ctx, request, chat, "/v1/messages", prepare_chat,
                                      anthropic_messages.MessagesFormatter)

    def adapter_cards() -> list[ModelCard]:
        # An adapter's parent is the base model (vLLM's field); root is its name, not its path on the server's disk.
        return [ModelCard(id=e.name, created=e.created, root=e.name, parent=e.parent, max_model_len=ctx.max_model_len())
                for e in ctx.loras.entries.values()]

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(dump(ModelList(data=[*(card(m) for m in ctx.served), *adapter_cards()])))

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        adapter = next((c for c in adapter_cards() if c.id == model_id), None)
        return JSONResponse(dump(adapter or card(ctx.served.resolve(model_id))))

    install_lora_routes(app, ctx)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> JSONResponse:
        return JSONResponse(dump(await tokenize_body(ctx, body)))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(dump(detokenize_body(ctx, body)))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvmesh_version()})

    probe = app.state.tokenizer_probe = HealthProbes(ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, status = await check_health(ctx, probe)
        return JSONResponse(status, status_code=200 if ok else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:  # SageMaker's health check, which goes with /invocations (vLLM serves both)
        return await health()

    @app.post("/v1/score")
    async def score(request: Request) -> JSONResponse:
        # A pooling model scores as vLLM's cross-encoder /score does; a generative one as SGLang's (label logprobs).
        raw = await _json_object(request)
        if ctx.config.pooling is not None:
            return await pooling_api.serve_cross_score(ctx, _validated(CrossScoreRequest, raw))
        body = _validated(ScoreRequest, raw)
        return await serve_score(ctx.for_model(body.model), body)

    register_pooling_routes(app, ctx)

    @app.get("/get_load")
    async def load() -> JSONResponse:
        return JSONResponse(get_load(ctx))

    @app.get("/get_server_info")
    async def info() -> JSONResponse:
        return JSONResponse(server_info(ctx))

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:  # SGLang's: what its clients read before sending work
        return JSONResponse({"model_path": ctx.config.model_dir, "tokenizer_path": ctx.config.model_dir,
                             "served_model_name": ctx.config.served_model_name, "is_generation": ctx.config.pooling is None,
                             "max_model_len": ctx.max_model_len()})

    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate(request: Request) -> Response:
        # SGLang's deep health check: one real token through the whole path (tokenizer, router, a decode worker).
        probe = CompletionRequest(prompt=[ctx.tokenizer.bos_token_id or 0], max_tokens=1, temperature=0)
        answer = await serve_generation(ctx, request, probe, "/v1/completions", prepare_completion, CompletionFormatter)
        if answer.status_code != 200:
            return answer
        return Response(status_code=200)

    @app.get("/load")
    async def server_load() -> JSONResponse:  # vLLM's server-load figure: requests the gateway is serving
        return JSONResponse({"server_load": ctx.in_flight})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await ctx.metrics.scrape(), media_type=CONTENT_TYPE)  # rendered off the loop

    return app
