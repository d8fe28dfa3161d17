"""The engine's compute loop in its own thread, behind a command queue, with an asyncio face.

Everything that touches the engine runs on this thread, for the engine's whole life: the thread builds it
(weights, warm-up, memory profile) and then steps it; commands from the event loop are queued and executed
between steps, so the engine itself needs no locks. Step results are handed back to the event loop through a
callback scheduled with call_soon_threadsafe.

Why one thread from the start: torch's CPU ops run in an OpenMP team per calling thread, and on a small CPU
two teams slow each other down. Measured on this project's 2-core CPU (SmolLM2 bf16, batch 1): 31 tok/s when
one thread builds and steps the engine, 21 tok/s once another thread has run a single parallel op
(loadtest/experiments/cpu_engine/engine_thread.py measures it). So the event loop's thread must never
compute with torch.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from shared.engine.block_events import BlockEvent
from shared.engine.commands import Command
from shared.engine.grammar_compile import GrammarCompiles
from shared.engine.llm_engine import LLMEngine
from shared.engine.outputs import RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_CHECK_S = 1.0  # how often an idle engine thread checks that the engine's processes live

# post_step(engine, outputs, events) runs on the engine thread right after a step, while every block
# still holds what the step left there (offload reads KV here); its result goes to on_step.
PostStep = Callable[[LLMEngine, list[RequestOutput], list[BlockEvent]], Any]
StepCallback = Callable[[list[RequestOutput], list[BlockEvent], Any], None]


class EngineStopped(RuntimeError):
    """A command for an engine thread that has stopped (crashed, or its worker is shutting down)."""


class EngineThread:
    def __init__(self, loop: asyncio.AbstractEventLoop, on_step: StepCallback,
                 post_step: PostStep | None = None) -> None:
        self.engine: LLMEngine | None = None  # built by the thread itself (start)
        self.loop = loop
        self.on_step = on_step
        self.post_step = post_step
        self.crashed = asyncio.Event()  # set on the loop if a step raised; the thread is gone then
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.grammar_compiles = GrammarCompiles()  # structured requests' constraints, compiled off this thread

    async def start(self, build: Callable[[], LLMEngine]) -> LLMEngine:
        """Start the thread: it calls build() (load, warm-up, profile) and then runs the step loop. Returns the
        engine once built; a build that raised raises here, and the thread is gone."""
        ready: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(build, ready), name="engine", daemon=True)
        self._thread.start()
        return await asyncio.wrap_future(ready)

    async def run(self, command: Command[T]) -> T:
        """Run a typed command on the engine thread between steps and return its result. A command admitting a
        structured request first waits for its constraint to compile on another thread (grammar_compile.py)."""
        params = getattr(command, "params", None)
        if params is not None and params.structured is not None and self.engine is not None:
            await self.grammar_compiles.ready(self.engine, params.structured)
        if not command.delivers_output:
            return await self.call(command.run)

        def run_and_deliver(engine: LLMEngine) -> T:
            out = command.run(engine)
            if out is not None:
                # Tokens a command produced go out like a step's, ahead of any later step's tokens.
                self.loop.call_soon_threadsafe(self.on_step, [out], [], None)
            return out
        return await self.call(run_and_deliver)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (services use run(Command); this is for
        benchmarks and tests that need to look inside)."""
        fut: Future = Future()
        if self._stopped.is_set():
            raise EngineStopped("engine thread is not running")
        self._commands.put((fn, fut))
        if self._stopped.is_set():
            self._fail_pending()
        return await asyncio.wrap_future(fut)

    def stop(self, timeout: float = 10.0) -> None:
        self.grammar_compiles.close()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run_command(self, item) -> bool:
        if item is None:
            return False
        fn, fut = item
        if fut.set_running_or_notify_cancel():
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - the caller gets the error, the loop lives on
                fut.set_exception(e)
                return True
            fut.set_result(result)
        return True

    def _run(self, build: Callable[[], LLMEngine], ready: Future) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # noqa: BLE001 - the starter gets the error
            self._stopped.set()
            ready.set_exception(e)
            return
        ready.set_result(self.engine)
        try:
            while True:
                # Block for commands when idle; otherwise drain what arrived and step.
                if not self.engine.has_work():
                    if not self._run_command(self._idle_wait()):
                        return
                while True:
                    try:
                        item = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._run_command(item):
                        return
                if not self.engine.has_work():
                    continue
                outputs = self.engine.step()
                events = self.engine.block_manager.drain_events()
                if outputs or events:
                    extra = self.post_step(self.engine, outputs, events) if self.post_step else None
                    self.loop.call_soon_threadsafe(self.on_step, outputs, events, extra)
        except Exception as e:  # noqa: BLE001 - reported to the owner, who fails its requests and exits
            log.exception("engine loop crashed")
            self.error = e
            self.loop.call_soon_threadsafe(self.crashed.set)
        finally:
            self._stopped.set()
            self._fail_pending()
            # The engine's other processes (tensor-parallel ranks) end with its thread, on the thread that
            # ran their collectives.
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - the worker is going down either way
                    log.exception("engine shutdown failed")

    def _idle_wait(self):  # noqa: ANN202 - the next queue item
        """The next command, checking meanwhile that the engine's other processes live (a tensor-parallel rank
        that died while the engine idles must end the worker now, not fail the next request)."""
        check = getattr(self.engine, "check_alive", None)  # None for a single-process engine: plain blocking get
        while True:
            try:
                return self._commands.get(timeout=IDLE_CHECK_S if check is not None else None)
            except queue.Empty:
                check()

    def _fail_pending(self) -> None:
        """Commands queued after the loop ended would wait forever: fail them."""
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineStopped("engine thread is not running"))
