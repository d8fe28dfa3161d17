"""Everything a gateway request handler needs, built once per app (no module-level state).

A mesh may serve several models (services/gateway/served_models.py): the app's context serves the first;
`for_model` gives the view of the same gateway that serves another (its tokenizer, router, subjects and
metrics label), sharing everything gateway-wide (config, connection, in-flight count, drain state)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from opentelemetry import trace
from transformers import PreTrainedTokenizerBase

from services.gateway.config import GatewayConfig
from services.gateway.lora_adapters import LoRAAdapters
from services.gateway.metrics import GatewayMetrics
from services.gateway.retry_after import RetryAdvice
from services.gateway.router import Router
from services.gateway.served_models import ServedModel, ServedModels
from shared.bus.limits import BusLimits
from shared.subjects import Subjects


@dataclass
class _Shared:
    """What every model's view of the gateway counts together."""

    in_flight: int = 0
    draining: bool = False


@dataclass
class GatewayContext:
    config: GatewayConfig
    nc: Client
    served: ServedModels
    tracer: trace.Tracer
    model: ServedModel | None = None  # the model this view serves (None: the first)
    # The gateway's own NATS input lag in seconds (services/gateway/input_lag.py; admission reads it).
    input_lag_s: Callable[[], float] = lambda: 0.0
    # The lag above which admission refuses, given --max-input-lag (InputLag.limit: the bound or the machine's floor).
    input_lag_limit_s: Callable[[float], float] = lambda bound: bound
    retry: RetryAdvice = field(default_factory=RetryAdvice)  # Retry-After of the requests admission refuses
    loras: LoRAAdapters = field(default_factory=lambda: LoRAAdapters(""))  # the mesh's LoRA adapters
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _shared: _Shared = field(default_factory=_Shared)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = self.served.default
            self._idle.set()

    def for_model(self, name: str | None) -> GatewayContext:
        """The view serving the model a request names (None: the first); 404 model_not_found for a name the
        gateway does not serve (ServedModels.resolve)."""
        adapter = self.loras.resolve(name)  # a LoRA adapter is served by its base model's workers
        model = self.served.resolve(adapter.parent if adapter is not None else name)
        return self if model is self.model else dataclasses.replace(self, model=model)

    # --- the view's model
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:  # for detokenizing streams; encoding is the tokenizer service's job
        return self.model.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def model_max_len(self) -> int:
        return self.model.model_max_len

    @property
    def router(self) -> Router:
        return self.model.router

    @property
    def metrics(self) -> GatewayMetrics:
        return self.model.metrics

    @property
    def subjects(self) -> Subjects:
        return self.model.subjects

    @property
    def created(self) -> int:  # unix time the model was loaded, for /v1/models
        return self.model.created

    @property
    def served_model_name(self) -> str:
        return self.model.name

    # --- the gateway's, shared by every view
    @property
    def in_flight(self) -> int:
        return self._shared.in_flight

    @property
    def draining(self) -> bool:
        return self._shared.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._shared.draining = value

    @functools.cached_property
    def stream_limits(self) -> BusLimits:
        """The bus limits of a token stream from a decode worker."""
        return BusLimits(reply_pending_msgs=self.config.stream_pending_msgs)

    @property
    def added_tokens(self) -> dict[int, str]:
        """The tokenizer's added tokens (services/gateway/special_tokens.py), read once per model."""
        return self.model.added_tokens

    def max_model_len(self) -> int:
        """The model's limit, or less when its live workers were started with a shorter one."""
        return self.model.max_model_len()

    def begin(self) -> None:
        self._shared.in_flight += 1
        self.model.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.labels(self.metrics.model).set(self.model.in_flight)

    def end(self) -> None:
        self._shared.in_flight -= 1
        self.model.in_flight -= 1
        self.retry.finished()
        self.metrics.in_flight.labels(self.metrics.model).set(self.model.in_flight)
        if self._shared.in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire-and-forget work that must outlive a cancelled request (e.g. its cancel message)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_background(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
