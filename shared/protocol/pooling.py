"""gateway -> engine worker (pooling runner): one input's hidden states pooled into one vector.

A pooling request is a prefill with no decode: the worker answers once, keeps no KV and sends none.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.wire import Message

POOL_TASKS = ("embed", "classify", "token")


class PoolRequest(Message):
    KIND: ClassVar[str] = "pool.request"

    request_id: str
    token_ids: list[int] = Field(min_length=1)
    # embed: the pooled vector (normalized unless told not to); classify: the head's logits through the
    # activation; token: every position's hidden state (/pooling), not pooled.
    task: str = "embed"
    normalize: bool | None = None  # None: the worker's pooler config
    activation: bool | None = None  # None: the worker's pooler config
    dimensions: int | None = None  # Matryoshka: the first `dimensions` values, normalized again


class PoolReply(Message):
    KIND: ClassVar[str] = "pool.reply"

    request_id: str
    # float32 little-endian values, rows x cols (rows is 1 except for task "token").
    data: bytes = b""
    rows: int = 0
    cols: int = 0
    num_tokens: int = 0
    error: str | None = None
