"""The models one gateway serves: model id -> its own subjects, router, tokenizer and metrics.

Every model of a mesh has its own tokenizer, prefill and decode pools on its own NATS subjects
(shared/subjects.py Subjects); the gateway keeps one ServedModel per model and serves a request with the one
its `model` field names (`ServedModels.resolve`, the one place a name becomes a model). The first model is the
default: a request without `model`, and the gateway-wide endpoints (/health_generate, /get_model_info), use it.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from services.gateway.errors import APIError
from services.gateway.metrics import GatewayMetrics
from services.gateway.queue_wait import QueueWait
from services.gateway.router import Router
from services.gateway.special_tokens import added_tokens
from shared.subjects import Subjects


@dataclass
class ServedModel:
    name: str  # the id clients send as `model`
    model_dir: str
    subjects: Subjects  # its tokenizer's and workers' subjects
    tokenizer: PreTrainedTokenizerBase  # for detokenizing streams; encoding is its tokenizer service's job
    vocab_size: int
    model_max_len: int  # the checkpoint's (or --max-model-len's) limit
    router: Router  # its decode workers
    metrics: GatewayMetrics  # the gateway's metrics, labelled with this model
    created: int  # unix time the gateway loaded it, for /v1/models
    in_flight: int = 0  # its generation requests being served
    # Its requests sent and not yet started, and how fast its workers start them (--max-queue-wait).
    queue: QueueWait = field(default_factory=QueueWait)

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """The tokenizer's added tokens (services/gateway/special_tokens.py), read once."""
        return added_tokens(self.tokenizer)

    def max_model_len(self) -> int:
        """The checkpoint's limit, or less when the live workers were started with a shorter one."""
        workers = self.router.max_model_len()
        return min(self.model_max_len, workers) if workers else self.model_max_len


def model_not_found(model: str) -> APIError:
    # vLLM's answer to a model it does not serve.
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


@dataclass
class ServedModels:
    models: list[ServedModel] = field(default_factory=list)

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        assert len(set(names)) == len(names), f"two models served as one name: {names}"

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def resolve(self, name: str | None) -> ServedModel:
        """The model a request's `model` names (None: the default one); a 404 model_not_found for any other."""
        if name is None:
            return self.default
        for m in self.models:
            if m.name == name:
                return m
        raise model_not_found(name)
