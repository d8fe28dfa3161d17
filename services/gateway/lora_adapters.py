"""The mesh's LoRA adapters as the gateway knows them: name -> (path, parent model, digest), the one list
/v1/models shows and requests are checked against.

Adapters given at start (--lora-modules) are loaded by every engine worker at its own start; adapters loaded
while serving (services/gateway/lora_routes.py) reach every worker known then, and `on_beat` sends them to a
worker that joins later (or restarted) and lacks one, and unloads from a worker one it holds that the mesh no
longer serves, so every worker converges on this list within a beat or two.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.models.lora_files import AdapterError, inspect_adapter
from shared.protocol.events import LoadBeat
from shared.protocol.lora import LoRAUpdate, LoRAUpdateReply

log = logging.getLogger(__name__)

Send = Callable[[str, LoRAUpdate], Awaitable[LoRAUpdateReply]]  # (worker id, update) -> its answer


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str
    parent: str  # the base model's served name
    digest: str  # its identity in block hashes (shared/models/lora_files.py), as the workers compute it
    created: int
    runtime: bool  # loaded through the API (the gateway keeps workers in step), not at start


class LoRAAdapters:
    def __init__(self, base: str, enabled: bool = False, runtime_updates: bool = False,
                 modules: tuple[tuple[str, str], ...] = ()) -> None:
        self.base = base
        self.enabled = enabled
        self.runtime_updates = runtime_updates
        self.entries: dict[str, AdapterEntry] = {}
        self._syncing: set[tuple[str, str]] = set()  # (worker, adapter) updates in flight from on_beat
        # Adapters a /v1/load_lora_adapter call is loading: workers that already hold one beat before it is in
        # `entries`, and must not be told to unload it meanwhile.
        self.pending: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        for name, path in modules:
            try:
                files = inspect_adapter(path)
            except AdapterError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
            self.add(AdapterEntry(name, files.path, base, files.digest, int(time.time()), runtime=False))

    def add(self, entry: AdapterEntry) -> None:
        self.entries[entry.name] = entry

    def remove(self, name: str) -> AdapterEntry | None:
        return self.entries.pop(name, None)

    def resolve(self, model: str | None) -> AdapterEntry | None:
        """The adapter a request's `model` names (None: the base model, or a name that is no adapter)."""
        return self.entries.get(model) if model is not None else None

    def route_key(self, name: str | None) -> tuple[str, str] | None:
        """(name, digest) of a request's adapter for the router (None: the base model)."""
        entry = self.entries.get(name) if name else None
        return (entry.name, entry.digest) if entry is not None else None

    # --- keeping workers in step ----------------------------------------------------------------

    def on_beat(self, beat: LoadBeat, send: Send) -> None:
        """A worker's beat: send it what it lacks of the runtime adapters, unload what the mesh dropped."""
        if not self.enabled:
            return
        held = set(beat.lora_adapters) - self.pending
        wanted = {n for n, e in self.entries.items() if e.runtime}
        startup = {n for n, e in self.entries.items() if not e.runtime}
        for name in wanted - held:
            e = self.entries[name]
            self._sync(beat.worker_id, LoRAUpdate(action="load", lora_name=name, lora_path=e.path), send)
        for name in held - wanted - startup:
            self._sync(beat.worker_id, LoRAUpdate(action="unload", lora_name=name), send)

    def _sync(self, worker_id: str, update: LoRAUpdate, send: Send) -> None:
        key = (worker_id, update.lora_name)
        if key in self._syncing:
            return
        self._syncing.add(key)

        async def run() -> None:
            try:
                reply = await send(worker_id, update)
                if not reply.ok:
                    log.warning("worker %s refused to %s adapter %s: %s", worker_id, update.action, update.lora_name,
                                reply.error)
            except Exception as e:  # noqa: BLE001 - the next beat tries again
                log.warning("could not %s adapter %s on worker %s: %s", update.action, update.lora_name, worker_id, e)
            finally:
                self._syncing.discard(key)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
