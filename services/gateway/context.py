"""Everything a gateway request handler needs, built once per app (no module-level state)."""
from __future__ import annotations

import asyncio
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
from services.gateway.special_tokens import added_tokens
from shared.bus.limits import BusLimits


@dataclass
class GatewayContext:
    config: GatewayConfig
    nc: Client
    tokenizer: PreTrainedTokenizerBase  # for detokenizing streams; encoding is the tokenizer service's job
    vocab_size: int
    model_max_len: int
    router: Router
    metrics: GatewayMetrics
    tracer: trace.Tracer
    created: int  # unix time the model was loaded, for /v1/models
    draining: bool = False
    # The gateway's own NATS input lag in seconds (services/gateway/input_lag.py; admission reads it).
    input_lag_s: Callable[[], float] = lambda: 0.0
    # The lag above which admission refuses, given --max-input-lag (InputLag.limit: the bound or the machine's floor).
    input_lag_limit_s: Callable[[float], float] = lambda bound: bound
    in_flight: int = 0
    retry: RetryAdvice = field(default_factory=RetryAdvice)
    loras: LoRAAdapters = field(default_factory=lambda: LoRAAdapters(""))  # the mesh's LoRA adapters  # Retry-After of the requests admission refuses
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._idle.set()

    @functools.cached_property
    def stream_limits(self) -> BusLimits:
        """The bus limits of a token stream from a decode worker."""
        return BusLimits(reply_pending_msgs=self.config.stream_pending_msgs)

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """The tokenizer's added tokens (services/gateway/special_tokens.py), read once."""
        return added_tokens(self.tokenizer)

    def max_model_len(self) -> int:
        """The checkpoint's limit, or less when the live workers were started with a shorter one."""
        workers = self.router.max_model_len()
        return min(self.model_max_len, workers) if workers else self.model_max_len

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()
        self.metrics.in_flight.labels(self.metrics.model).set(self.in_flight)

    def end(self) -> None:
        self.in_flight -= 1
        self.retry.finished()
        self.metrics.in_flight.labels(self.metrics.model).set(self.in_flight)
        if self.in_flight == 0:
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
