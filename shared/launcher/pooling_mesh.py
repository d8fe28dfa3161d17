"""`kvmesh up --runner pooling`: a mesh that embeds or classifies instead of generating.

A pooling request is a prefill with no decode, so the mesh is prefill workers in the pooling runner
(services/prefill/pooling_service.py) and no decode worker; the gateway serves the pooling routes and answers
generation routes with a 400. On the CPU the one-engine-process rule of shared/launcher/cpu_layout.py holds
the same way: one pooling worker unless --prefill asks for more.
"""
from __future__ import annotations

import argparse

from shared.models.pooling_config import CONVERTS, PoolerConfig


def add_pooling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runner", choices=["generate", "pooling"], default="generate",
                        help="pooling: serve the model for embeddings, reranking and classification (/v1/embeddings, "
                             "/v1/rerank, /v1/score, /classify, /pooling) on prefill workers in the pooling runner, "
                             "no decode worker (default generate)")
    parser.add_argument("--convert", choices=CONVERTS, default=None,
                        help="--runner pooling: embed or classify (default auto: classify for a "
                             "*ForSequenceClassification checkpoint, else embed)")
    parser.add_argument("--pooler-config", default=None, metavar="JSON",
                        help='--runner pooling: vLLM\'s pooler JSON, e.g. {"pooling_type": "MEAN", "normalize": '
                             "false} (pooling_type LAST, MEAN or CLS; normalize; activation/softmax for classifiers)")


def pooling_options(args: argparse.Namespace, prefill: int | None = None) -> dict[str, object]:
    """MeshOptions fields of the pooling flags (with a pooling mesh's worker counts; `prefill`: the count given,
    None for the default); AssertionError with the reason when they cannot make a mesh."""
    runner = getattr(args, "runner", "generate")
    if runner != "pooling":
        assert args.convert is None and args.pooler_config is None, "--convert and --pooler-config need --runner pooling"
        return {}
    assert args.decode is None, "--runner pooling runs no decode worker: leave out --decode"
    assert len(args.model or []) <= 1, "--runner pooling serves one model (one --model)"
    PoolerConfig.parse(args.pooler_config)  # a bad JSON is one error now, not a crash loop of every worker
    return {"runner": "pooling", "convert": args.convert, "pooler_config": args.pooler_config,
            "prefill": 1 if prefill is None else prefill, "decode": 0,
            "kvstore": 0}  # a kvstore holds KV blocks, and a pooling mesh keeps none
