"""gateway -> every engine worker: load or unload a LoRA adapter while serving.

The gateway owns the mesh's list of adapters (services/gateway/lora_adapters.py). A runtime load or unload is
one request per engine worker (decode and prefill alike, since a prefill worker must compute a prompt with the
same adapter as its decode worker) on that worker's own subject, `kvmesh.lora.update.<worker_id>`; each answers
when its engine has done it (or says why it cannot). Workers report the adapters they hold in their load beats
(LoadBeat.lora_adapters), so the gateway also sends a runtime-loaded adapter to a worker that joins later.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from shared.wire import Message


class LoRAUpdate(Message):
    KIND: ClassVar[str] = "lora.update"

    action: Literal["load", "unload"]
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = ""  # load only: the adapter's directory, as the worker's machine sees it


class LoRAUpdateReply(Message):
    KIND: ClassVar[str] = "lora.update_reply"

    worker_id: str
    ok: bool
    error: str = ""  # why not (an adapter the worker refuses: the message for the client's 400)
    adapters: list[str] = Field(default_factory=list)  # what the worker holds afterwards
