"""The FastAPI app: OpenAI routes, /health and /metrics, over one GatewayContext."""
from __future__ import annotations

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.auth import check_api_key
from services.gateway.context import GatewayContext
from services.gateway.endpoint import serve_generation
from services.gateway.errors import install_error_handlers
from services.gateway.health import check_health
from services.gateway.metrics import CONTENT_TYPE
from services.gateway.prepare import prepare_chat, prepare_completion
from services.gateway.responses import ChatFormatter, CompletionFormatter
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, dump


def create_app(ctx: GatewayContext) -> FastAPI:
    app = FastAPI(title="kvmesh gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)

    def authorized(authorization: str | None = Header(default=None)) -> None:
        check_api_key(ctx.config.api_key, authorization)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve_generation(ctx, request, body, "/v1/completions", prepare_completion, CompletionFormatter)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve_generation(ctx, request, body, "/v1/chat/completions", prepare_chat, ChatFormatter)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> JSONResponse:
        name = ctx.config.served_model_name
        card = ModelCard(id=name, created=ctx.created, root=ctx.config.model_dir, max_model_len=ctx.max_model_len())
        return JSONResponse(dump(ModelList(data=[card])))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, status = await check_health(ctx)
        return JSONResponse(status, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app
