"""The gateway's side of `--runner pooling`: which model it serves and which endpoints that model answers.

A pooling mesh runs prefill workers in the pooling runner and no decode worker: generation routes answer
400 there, and the pooling routes answer 400 on a generating mesh (which has no worker to compute them).
"""
from __future__ import annotations

import argparse

from services.gateway.errors import APIError, bad_request
from shared.engine.errors import ConfigError
from shared.models.pooling_config import CONVERTS, PoolerConfig, PoolingConfigError, PoolingSpec, pooling_spec


def add_pooling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                        help="pooling: the model embeds or classifies (/v1/embeddings, /v1/rerank, /v1/score, "
                             "/classify, /pooling), served by prefill workers in the pooling runner")
    parser.add_argument("--convert", choices=CONVERTS, default="auto",
                        help="--runner pooling: embed or classify (auto: from the checkpoint's architecture)")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help="--runner pooling: the workers' pooler JSON (the gateway checks it the same way)")


def pooling_from_args(args: argparse.Namespace) -> PoolingSpec | None:
    if getattr(args, "runner", "generate") != "pooling":
        return None
    try:
        return pooling_spec(args.models[0], args.convert, PoolerConfig.parse(args.pooler_config))
    except PoolingConfigError as e:
        raise ConfigError(str(e)) from None


def not_generative(ctx, route: str) -> APIError:  # noqa: ANN001 - a GatewayContext
    spec = ctx.config.pooling
    return bad_request(f"the model `{ctx.config.served_model_name}` is a pooling model ({spec.task}, --runner "
                       f"pooling): it does not generate text, so {route} is not served; use "
                       f"{'/v1/embeddings' if spec.task == 'embed' else '/v1/rerank, /v1/score or /classify'}",
                       param="model", code="model_not_generative")


def require_pooling(ctx, route: str, task: str | None = None) -> PoolingSpec:  # noqa: ANN001
    """The served pooling model, when it can answer `route` (task: the one it needs), else a 400."""
    spec = ctx.config.pooling
    if spec is None:
        raise bad_request(f"the model `{ctx.config.served_model_name}` is a generative model: {route} needs a "
                          "pooling model (kvmesh up --runner pooling)", param="model", code="model_not_pooling")
    if task is not None and spec.task != task:
        need = "an embedding model (--convert embed)" if task == "embed" else \
            "a classification model (a *ForSequenceClassification checkpoint)"
        raise bad_request(f"{route} needs {need}; the model `{ctx.config.served_model_name}` is served for "
                          f"{spec.task}", param="model", code="wrong_pooling_task")
    return spec
