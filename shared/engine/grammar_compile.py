"""Structured-output constraints compiled off the engine thread, before the request reaches the engine.

Compiling a JSON schema or grammar (xgrammar) takes from milliseconds to seconds depending on the constraint,
which the client chooses. On the engine thread, inside admission, that time stalls every stream of the worker
while its beats keep saying it is fine. So a command that admits a structured request first waits here, in a
compiling state as vLLM's requests do, while one compile thread fills the backend's cache (xgrammar releases the
GIL while it works); on the engine thread admission then finds the compiled grammar, or the cached error. A
request cancelled meanwhile never reaches the engine. One thread: compiles queue behind each other instead of
taking every core (each one is bounded by the constraint's size and depth: shared/sampling_params.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.sampling_params import StructuredOutput


class GrammarCompiles:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.compiled = 0  # constraints compiled here (tests read it)

    async def ready(self, engine: Any, so: StructuredOutput) -> None:
        """Returns once `so` is compiled (or known to be invalid) in engine's grammar backend's cache."""
        backend: Callable[[], Any] | None = getattr(engine, "grammar", None)
        if backend is None:  # an engine without structured outputs refuses the request itself
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, self._compile, backend, so)

    def _compile(self, backend: Callable[[], Any], so: StructuredOutput) -> None:
        try:
            backend().compile(so)
        except ValueError:
            pass  # cached; admission raises it again as the request's error
        self.compiled += 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
