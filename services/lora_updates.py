"""An engine worker's side of runtime LoRA updates (shared/protocol/lora.py): each load or unload the gateway
sends on this worker's own subject runs on the engine thread between steps, and the answer says what the worker
holds afterwards or why it refused (a bad adapter: the gateway's 400)."""
from __future__ import annotations

import logging

from nats.aio.client import Client

from shared import bus, subjects
from shared.engine.engine_thread import EngineThread
from shared.engine.lora_commands import LoadLoRA, UnloadLoRA
from shared.protocol.lora import LoRAUpdate, LoRAUpdateReply

log = logging.getLogger(__name__)


async def serve_lora_updates(nc: Client, worker_id: str, thread: EngineThread, on_change) -> bus.Served:  # noqa: ANN001
    """on_change(): called after a change (the worker beats at once, so routers see the adapter)."""

    async def on_update(msg: LoRAUpdate, _: bus.RequestContext) -> LoRAUpdateReply:
        command = LoadLoRA(msg.lora_name, msg.lora_path) if msg.action == "load" else UnloadLoRA(msg.lora_name)
        try:
            names = await thread.run(command)
        except ValueError as e:  # AdapterError included: the adapter, not the worker, is at fault
            return LoRAUpdateReply(worker_id=worker_id, ok=False, error=str(e))
        on_change()
        return LoRAUpdateReply(worker_id=worker_id, ok=True, adapters=names)

    return await bus.serve(nc, subjects.lora_update(worker_id), None, on_update, LoRAUpdate)
