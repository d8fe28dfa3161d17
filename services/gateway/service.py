"""The gateway as a mesh service: uvicorn serving the FastAPI app, fed by the decode workers'
cache events and load beats. The service runner owns signals; drain() stops the HTTP server."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import uvicorn
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from opentelemetry import trace

from services.gateway.app import create_app
from services.gateway.beat_check import beat_problem
from services.gateway.config import GatewayConfig, ModelEntry
from services.gateway.reasoning import PARSERS as REASONING_PARSERS
from services.gateway.tools import PARSERS
from services.gateway.context import GatewayContext
from services.gateway.input_lag import InputLag
from services.gateway.lora_adapters import LoRAAdapters
from services.gateway.lora_routes import send_update
from shared.gateway_flags import add_gateway_flags
from shared.engine.lora_config import add_lora_arguments, lora_enabled, parse_lora_modules
from services.gateway.metrics import GatewayMetrics
from services.gateway.pooling_mode import add_pooling_flags, pooling_from_args
from services.gateway.router import Router, RouterConfig
from services.gateway.served_models import ServedModel, ServedModels
from shared import bus, subjects
from shared.bus.limits import BEAT_MAX_BYTES, EVENT_MAX_BYTES
from shared.subjects import Subjects, model_namespace
from shared.bus import MicroService
from shared.models.model_config import load_model_config
from shared.models.tokenizer import load_tokenizer
from shared.protocol.events import BlockRemoved, BlockStored, LoadBeat
from shared.protocol.kvstore import StatsReply
from shared.service_runner import Service, main_for

log = logging.getLogger(__name__)
VERSION = "0.1.0"


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM/SIGINT belong to the service runner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


class GatewayService(Service):
    name = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.ctx: GatewayContext | None = None
        self._server: _Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._deaf_watch: asyncio.Future | None = None
        self._subs: list[Subscription] = []
        self._micro: MicroService | None = None
        self._input_lag: InputLag | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        assert self._server is not None and self._server.servers, "not serving"
        return self._server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def _load_models(self) -> ServedModels:
        """Each served model's tokenizer, limits, router and metrics (services/gateway/served_models.py)."""
        cfg = self.config
        models: list[ServedModel] = []
        metrics: GatewayMetrics | None = None
        for entry in cfg.models:
            tokenizer = await asyncio.to_thread(load_tokenizer, entry.model_dir)
            if cfg.pooling is not None and cfg.pooling.encoder:  # an encoder is no decoder: its sizes from the spec
                vocab_size, longest = cfg.pooling.vocab_size, cfg.pooling.max_position_embeddings
            else:
                model_config = load_model_config(entry.model_dir)
                vocab_size, longest = model_config.vocab_size, model_config.max_position_embeddings
            router = Router(RouterConfig(expiry_s=cfg.worker_expiry_s, max_waiting=cfg.max_waiting, policy=cfg.routing))
            name = entry.served_model_name
            metrics = GatewayMetrics(router, name) if metrics is None else metrics.for_model(name, router)
            models.append(ServedModel(
                name=name, model_dir=entry.model_dir, subjects=Subjects(entry.namespace), tokenizer=tokenizer,
                vocab_size=vocab_size, model_max_len=min(cfg.max_model_len or longest, longest),
                router=router, metrics=metrics, created=int(time.time())))
        return ServedModels(models)

    async def start(self, nc: Client) -> None:
        cfg = self.config
        self.ctx = ctx = GatewayContext(config=cfg, nc=nc, served=await self._load_models(),
                                        tracer=trace.get_tracer("kvmesh.gateway"),
                                        loras=LoRAAdapters(cfg.served_model_name, cfg.enable_lora,
                                                           cfg.allow_runtime_lora_updating, cfg.lora_modules))
        ctx.metrics.max_inflight.labels(ctx.metrics.model).set(cfg.max_inflight_requests)
        self._input_lag = InputLag(nc)
        await self._input_lag.start()
        ctx.input_lag_s = self._input_lag.seconds
        ctx.input_lag_limit_s = self._input_lag.limit
        ctx.metrics.input_lag.labels(ctx.metrics.model).set_function(self._input_lag.seconds)

        async def on_kvstore_event(ev: BlockStored | BlockRemoved | StatsReply, _: bus.RequestContext) -> None:
            if isinstance(ev, StatsReply):
                ctx.metrics.kvstore.on_stats(ev)
            elif ev.tier == "kvstore":
                # One kvstore for every model: each model's blocks are salted apart, so only its router matches them.
                for model in ctx.served:
                    r = model.router
                    (r.on_kvstore_stored if isinstance(ev, BlockStored) else r.on_kvstore_removed)(ev)

        self._subs = [await bus.subscribe(nc, subjects.KVSTORE_EVENTS, on_kvstore_event,
                                          (BlockStored, BlockRemoved, StatsReply), traced=False,
                                          max_bytes=EVENT_MAX_BYTES)]
        for model in ctx.served:
            # LoRA adapters are the first model's: its workers are kept in step with the mesh's adapters.
            keep = partial(ctx.loras.on_beat, send=partial(send_update, ctx)) if model is ctx.served.default else None
            self._subs += await _follow_workers(nc, model, keep)
        self._deaf_watch = asyncio.ensure_future(_keep_workers_while_deaf(nc, [m.router for m in ctx.served]))
        self._micro = await bus.add_micro_service(nc, subjects.SERVICE_GATEWAY, VERSION, [],
                                                  description="OpenAI-compatible HTTP gateway",
                                                  metadata={"model": ",".join(m.name for m in ctx.served)})
        uv = uvicorn.Config(create_app(ctx), host=cfg.host, port=cfg.port, lifespan="off", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=None)
        self._server = _Server(uv)
        self._serving = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # e.g. the port is taken: raise it here
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.02)
        log.info("gateway listening on %s for model(s) %s", self.url, ", ".join(m.name for m in ctx.served))
        if open_to_network(cfg.host) and not cfg.api_key:
            log.warning(NO_KEY_WARNING, cfg.host)

    async def stop_intake(self) -> None:
        if self.ctx is not None:
            self.ctx.draining = True  # new requests get 503 at once

    def in_flight(self) -> int:
        return self.ctx.in_flight if self.ctx is not None else 0

    async def release(self, remaining_s: float) -> None:
        """Closes the HTTP server (cancelling what still runs), then the bus side."""
        if self._server is not None:
            self._server.should_exit = True
            if self._serving is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._serving), 5)
                if not self._serving.done():
                    self._server.force_exit = True
                    await asyncio.gather(self._serving, return_exceptions=True)
        if self.ctx is not None:
            await asyncio.wait_for(self.ctx.wait_background(), 2)  # cancels of aborted requests still going out
        if self._deaf_watch is not None:
            self._deaf_watch.cancel()
        if self._input_lag is not None:
            await self._input_lag.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()

    async def wait_closed(self) -> None:
        assert self._serving is not None, "start() first"
        await asyncio.shield(self._serving)


NO_KEY_WARNING = ("SECURITY: the gateway listens on %s, beyond this machine, with no API key: anyone who can reach "
                  "it can use the model. Set KVMESH_API_KEY (or bind to 127.0.0.1).")


def open_to_network(host: str) -> bool:
    """Whether a bind address reaches beyond loopback."""
    return not (host in ("localhost", "::1") or host.startswith("127."))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", dest="models", required=True, action="append",
                        help="HF checkpoint directory (tokenizer + config.json); repeat it for each model of the mesh "
                             "(the i-th model's tokenizer and workers use the i-th model's subjects)")
    parser.add_argument("--served-model-name", default=None, action="append",
                        help="name clients use (default: the directory name); one per --model, in the same order")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-input-lag", type=float, default=GatewayConfig.max_input_lag_s, metavar="SECONDS",
                        help="while the gateway's own NATS input lags more than this (or 3x the smallest lag of "
                             "the last 30 s, when that is more: the busy machine's floor), new requests get 429 "
                             "with Retry-After (0: off)")
    parser.add_argument("--max-waiting", type=int, default=128,
                        help="per decode worker: at this many waiting requests it takes no new ones (503 when all are)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the checkpoint's)")
    parser.add_argument("--migration-limit", type=int, default=3,
                        help="times a request may move to another decode worker when its worker dies (0: never)")
    parser.add_argument("--max-body-bytes", type=int, default=None,
                        help="request body limit, 413 above it (default: 1 MiB + 64 bytes per token of context)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="max_tokens when a request gives none, capped by the context left; 0: the whole context")
    parser.add_argument("--stream-idle-timeout", type=float, default=120.0,
                        help="seconds a decode worker may stay silent mid-request")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split reasoning from the answer (default: when the chat template writes <think> blocks)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="how the model writes tool calls under tool_choice auto (default: read from the chat template)")
    parser.add_argument("--structured-outputs-in-reasoning", action="store_true",
                        help="apply structured outputs and forced tool calls to a reasoning model's <think> text too "
                             "(default: they start after it, as vLLM)")
    add_gateway_flags(parser, launcher=False)
    add_pooling_flags(parser)
    add_lora_arguments(parser, engine=False, gateway=True)


def build(args: argparse.Namespace) -> GatewayService:
    from shared.models.model_source import resolve_model

    names, dirs = args.served_model_name or [], args.models
    if len(names) > len(dirs):
        raise SystemExit(f"gateway: {len(names)} --served-model-name for {len(dirs)} --model")
    # A .gguf (or a directory holding one) -> its cached checkpoint directory, as for every service's --model.
    models = [ModelEntry(resolve_model(model), name or Path(resolve_model(model)).resolve().name, model_namespace(i))
              for i, (model, name) in enumerate(zip(dirs, [*names, *[None] * (len(dirs) - len(names))]))]
    return GatewayService(GatewayConfig(
        model_dir=models[0].model_dir, served_model_name=models[0].served_model_name, more_models=tuple(models[1:]),
        host=args.host, port=args.port, max_waiting=args.max_waiting, max_inflight_requests=args.max_inflight_requests,
        max_input_lag_s=args.max_input_lag, max_queue_wait_s=args.max_queue_wait,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens, stream_idle_timeout_s=args.stream_idle_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        api_key=os.environ.get("KVMESH_API_KEY") or None, max_body_bytes=args.max_body_bytes,
        migration_limit=args.migration_limit, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
        routing=args.routing, scheduling_policy=args.scheduling_policy, pooling=pooling_from_args(args),
        trust_request_chat_template=args.trust_request_chat_template, max_request_tokens=args.max_request_tokens,
        trusted_hosts=tuple(h.strip() for h in args.trusted_hosts.split(",") if h.strip()) if args.trusted_hosts else None,
        enable_lora=lora_enabled(args), lora_modules=parse_lora_modules(args.lora_modules),
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    ))


def main(argv: list[str] | None = None) -> int:
    return main_for("gateway", add_arguments, build, argv)


def _speaks_for_itself(worker_id: str, subject: str) -> bool:
    try:
        return subjects.worker_from_subject(subject) == worker_id
    except ValueError:
        return False


async def _follow_workers(nc: Client, model: ServedModel,
                          keep_in_step: Callable[[LoadBeat], None] | None = None) -> list[Subscription]:
    """Subscribes a model's router and worker gauges to its workers' block events and load beats (its own
    subjects: another model's workers never enter its router)."""
    router, sub = model.router, model.subjects

    async def on_event(ev: BlockStored | BlockRemoved, msg: bus.RequestContext) -> None:
        # A worker speaks only for itself: the id in the event must be the subject's (the bus lets each
        # worker publish only on its own subject).
        if not _speaks_for_itself(ev.worker_id, msg.subject):
            log.warning("ignoring a block event for %r on %r", ev.worker_id, msg.subject)
            return
        if isinstance(ev, BlockStored):
            router.on_stored(ev)
        else:
            router.on_removed(ev)

    def believable(beat: LoadBeat, msg: bus.RequestContext, role: str) -> bool:
        problem = beat_problem(beat, msg.subject, model.model_max_len, role)
        if problem is not None:
            log.warning("ignoring a load beat: %s", problem)
        return problem is None

    async def on_beat(beat: LoadBeat, msg: bus.RequestContext) -> None:
        if believable(beat, msg, "decode"):
            router.on_beat(beat)
            if keep_in_step is not None:
                keep_in_step(beat)

    async def on_prefill_beat(beat: LoadBeat, msg: bus.RequestContext) -> None:
        router.heard()  # the gateway hears beats: the router judges decode workers' silence by it
        if believable(beat, msg, "prefill"):
            model.metrics.prefill_workers.on_beat(beat)
            if keep_in_step is not None:
                keep_in_step(beat)

    # Mesh state, not any request's work: no span per beat or block event (shared/bus/server.py, subscribe).
    return [
        await bus.subscribe(nc, sub.decode_events_all, on_event, (BlockStored, BlockRemoved), traced=False,
                            max_bytes=EVENT_MAX_BYTES),
        await bus.subscribe(nc, sub.decode_load_all, on_beat, LoadBeat, traced=False, max_bytes=BEAT_MAX_BYTES),
        await bus.subscribe(nc, sub.prefill_load_all, on_prefill_beat, LoadBeat, traced=False,
                            max_bytes=BEAT_MAX_BYTES),
    ]


async def _keep_workers_while_deaf(nc, routers: list[Router], period_s: float = 0.1) -> None:  # noqa: ANN001
    """While the gateway's own NATS connection is down (its server died; it is reconnecting), no beat can
    reach it: that says nothing about the workers, so none of them expires for it. Just after a reconnect
    every worker counts as just heard from; one that really died meanwhile expires a beat period later."""
    reconnects = nc.stats["reconnects"]
    while True:
        if not nc.is_connected or nc.stats["reconnects"] != reconnects:
            reconnects = nc.stats["reconnects"]
            for router in routers:
                router.heard_from_all()
        await asyncio.sleep(period_s)
