"""decode worker -> decode workers (fan-out): finished outputs, for the other workers' suffix tables.

Shared suffix decoding (services/decode/suffix_sharing.py): each worker publishes the output tokens of the
requests it finished, and every other worker of the same model adds them to its worker-wide suffix table under
the same cache salt, so an answer of a kind one worker has seen drafts well on all of them."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.wire import Message, WireModel


class SharedOutput(WireModel):
    cache_salt: str | None = None  # the request's cache salt: its tokens teach only that salt's table
    token_ids: list[int]  # the output's last tokens (the publisher bounds them)


class SuffixOutputs(Message):
    KIND: ClassVar[str] = "decode.suffix_outputs"

    worker_id: str
    # The publisher's block-hash root (model id, block size, KV dtype): tokens mean something only to a worker
    # of the same model and tokenizer, which has the same root.
    hash_root: bytes
    outputs: list[SharedOutput] = Field(default_factory=list)
