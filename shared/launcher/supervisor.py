"""Runs child processes: forwards their output with a `[name]` prefix, restarts the ones that die,
and stops them in order (SIGTERM, wait, SIGKILL).

Each child gets its own session (process group), so a Ctrl-C in the terminal reaches only the
launcher, which then stops the children in order: services first, while the nats-server they
drain through is still up. Signals go to the child's whole group so helper processes a service
may spawn go with it.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.engine.errors import EXIT_CONFIG
from shared.launcher.process_spec import ProcessSpec

Emit = Callable[[str], None]


def print_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the launcher dies, however it dies (SIGKILL, OOM), so
    no service outlives it; the signal starts the service's normal drain."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own stop() is all there is
        pass


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


@dataclass(frozen=True)
class Backoff:
    """Restart delays: initial, doubling up to maximum; a child that ran `reset_after` seconds
    starts over at `initial` (it was healthy, so this death is a new incident)."""

    initial: float = 1.0
    maximum: float = 30.0
    reset_after: float = 30.0

    def next(self, previous: float | None, uptime: float) -> float:
        if previous is None or uptime >= self.reset_after:
            return self.initial
        return min(previous * 2, self.maximum)


@dataclass
class Child:
    spec: ProcessSpec
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    last_exit: int | None = None
    stopping: bool = False
    failed_config: bool = False  # exited EXIT_CONFIG: never restarted
    stopped: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # ends a restart wait early
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def status(self) -> str:
        if self.running:
            state = f"{self.spec.name}: running (pid {self.proc.pid})"  # type: ignore[union-attr]
            if self.last_exit is not None:
                state += f", restarted {self.starts - 1} time(s), last exit {describe_exit(self.last_exit)}"
            return state
        if self.failed_config:
            return f"{self.spec.name}: not running (cannot start with its configuration; not restarted)"
        if self.last_exit is None:
            return f"{self.spec.name}: starting"
        return f"{self.spec.name}: not running (exited {self.starts} time(s), last with {describe_exit(self.last_exit)})"


class Supervisor:
    def __init__(self, emit: Emit = print_line, backoff: Backoff = Backoff(),
                 on_config_failure: Callable[[str], None] | None = None) -> None:
        self._emit = emit
        self._backoff = backoff
        self._on_config_failure = on_config_failure  # called with the name of a child that exited EXIT_CONFIG
        self._children: dict[str, Child] = {}

    @property
    def children(self) -> dict[str, Child]:
        return dict(self._children)

    async def start(self, spec: ProcessSpec) -> Child:
        """Starts `spec` and keeps it running until stop(); returns once the first process exists."""
        assert spec.name not in self._children, f"duplicate process name {spec.name}"
        child = Child(spec)
        self._children[spec.name] = child
        started = asyncio.Event()
        child.task = asyncio.create_task(self._keep_running(child, started), name=f"supervise-{spec.name}")
        await started.wait()
        return child

    def forget(self, name: str) -> None:
        """Drop a stopped child's record, so a new process may take its name (a planner's new worker)."""
        child = self._children.get(name)
        if child is not None:
            assert child.stopping and not child.running, f"{name} is still running"
            del self._children[name]

    async def stop(self, names: Iterable[str], timeout: float, hurry: asyncio.Event | None = None) -> dict[str, int | None]:
        """SIGTERM to each, SIGKILL to those still up after `timeout` s (or as soon as `hurry` is
        set: a second Ctrl-C); returns their exit codes (None for one that was not running, e.g.
        waiting for its restart)."""
        children = [self._children[n] for n in names if n in self._children]
        was_running = {c.spec.name for c in children if c.running}
        for child in children:
            child.stopping = True
            child.stopped.set()
            self._signal(child, signal.SIGTERM)
        tasks = [c.task for c in children if c.task is not None]
        if tasks:
            all_done = asyncio.ensure_future(asyncio.wait(tasks, timeout=timeout))
            waits = {all_done} | ({asyncio.ensure_future(hurry.wait())} if hurry is not None else set())
            _, unfinished = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in unfinished:
                w.cancel()
        pending = {t for t in tasks if not t.done()}
        for child in children:
            if child.task in pending and child.running:
                self._emit(f"[kvmesh] {child.spec.name} did not stop in time; killing it")
                self._signal(child, signal.SIGKILL)
        if pending:
            await asyncio.wait(pending, timeout=5)
        return {c.spec.name: (c.last_exit if c.spec.name in was_running else None) for c in children}

    async def _keep_running(self, child: Child, started: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        delay: float | None = None
        while not child.stopping:
            try:
                child.proc = await asyncio.create_subprocess_exec(
                    *child.spec.argv,
                    env={**os.environ, **child.spec.env},
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            except OSError as e:  # e.g. the executable vanished: report like a death, retry
                self._emit(f"[kvmesh] {child.spec.name} could not start: {e}")
                child.last_exit = 127
            else:
                child.starts += 1
                self._emit(f"[kvmesh] started {child.spec.name} (pid {child.proc.pid})")
                if child.stopping:  # stop() ran while the process was being created: it missed the SIGTERM
                    self._signal(child, signal.SIGTERM)
            started.set()
            t0 = loop.time()
            if child.proc is not None and child.proc.returncode is None:
                await self._forward(child.spec.name, child.proc)
                child.last_exit = await child.proc.wait()
            if child.stopping:
                self._emit(f"[kvmesh] {child.spec.name} stopped ({describe_exit(child.last_exit or 0)})")
                return
            if child.last_exit == EXIT_CONFIG:
                # Its configuration cannot work (e.g. the memory budget does not fit): a restart would
                # fail the same way, over and over, so it stays down and the mesh is told.
                child.failed_config = True
                self._emit(f"[kvmesh] {child.spec.name} cannot start with its configuration "
                           f"({describe_exit(EXIT_CONFIG)}); not restarting it")
                if self._on_config_failure is not None:
                    self._on_config_failure(child.spec.name)
                return
            delay = self._backoff.next(delay, loop.time() - t0)
            self._emit(
                f"[kvmesh] {child.spec.name} exited with {describe_exit(child.last_exit or 0)}; restarting in {delay:.1f}s"
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.stopped.wait(), delay)

    async def _forward(self, name: str, proc: asyncio.subprocess.Process) -> None:
        # Chunked reads, not readline(): a huge line (a stack dump, a long prompt in a log) must
        # not raise inside the supervisor.
        assert proc.stdout is not None
        pending = b""
        while chunk := await proc.stdout.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self._emit(f"[{name}] {line.decode(errors='replace')}")
        if pending:
            self._emit(f"[{name}] {pending.decode(errors='replace')}")

    @staticmethod
    def _signal(child: Child, sig: signal.Signals) -> None:
        if not child.running:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, sig)  # type: ignore[union-attr]  # own session: pgid == pid
