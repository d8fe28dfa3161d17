"""decode worker -> decode workers (fan-out): finished outputs, for the other workers' suffix tables.

Shared suffix decoding (services/decode/suffix_sharing.py): each worker publishes the output tokens of the
requests it finished, and every other worker of the same model adds them to its worker-wide suffix table under
the same cache salt, so an answer of a kind one worker has seen drafts well on all of them.

Neither a request's cache salt (a tenant's secret) nor the block-hash root (derived from the mesh's secret:
whoever has it can hash blocks for a predicted prompt) travels: each is sent as a one-way tag keyed by the
root, which only workers of the same model and mesh can compute and compare."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.wire import Message, WireModel


class SharedOutput(WireModel):
    # A tag of the request's cache salt (None: unsalted): its tokens teach only the table of the salt with that tag.
    salt_tag: bytes | None = Field(default=None, max_length=32)
    token_ids: list[int] = Field(max_length=4096)  # the output's last tokens (the publisher bounds them)


class SuffixOutputs(Message):
    KIND: ClassVar[str] = "decode.suffix_outputs"

    worker_id: str
    # A tag of the publisher's block-hash root (model id, block size, KV dtype, mesh secret): tokens mean
    # something only to a worker of the same model and tokenizer, which computes the same tag.
    model_tag: bytes = Field(max_length=32)
    outputs: list[SharedOutput] = Field(default_factory=list, max_length=1024)
