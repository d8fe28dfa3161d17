"""The one lifecycle every kvmesh service shares.

connect -> start (subscribe endpoints, register with nats.micro) -> wait for SIGTERM/SIGINT ->
drain (stop taking work, finish or cancel in-flight work within the grace period) -> drain the
NATS connection -> exit 0. `python -m services.<name>` and `kvmesh serve <name>` both end up here.
"""
from __future__ import annotations

import abc
import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

from nats.aio.client import Client

from shared import bus
from shared.engine.errors import EXIT_CONFIG, ConfigError, MemoryBudgetError
from shared.telemetry import setup_tracing

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 10.0


class Service(abc.ABC):
    """A mesh service. Subclasses own their endpoints and in-flight work; the runner owns the process."""

    name: str  # "gateway", "tokenizer", "prefill", "decode", "kvstore"

    @abc.abstractmethod
    async def start(self, nc: Client) -> None:
        """Subscribe endpoints and start background tasks; return once serving."""

    async def drain(self, grace_s: float) -> None:
        """The one shutdown sequence of every service: stop taking new work, give the work in flight up
        to grace_s seconds to finish, abort what is left (its callers get an answer), release the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        await self.stop_intake()
        while self.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight():
            log.warning("%s: %d requests still running after %.1fs; aborting them", self.name, self.in_flight(), grace_s)
            await self.abort_in_flight()
        await self.release(max(0.0, deadline - loop.time()))

    @abc.abstractmethod
    async def stop_intake(self) -> None:
        """New work is refused (or no longer delivered) from here on; work in flight goes on."""

    @abc.abstractmethod
    def in_flight(self) -> int:
        """Requests still being served."""

    async def abort_in_flight(self) -> None:
        """End what is still running after the grace period, answering its callers (default: nothing
        to do, release() cancels it)."""

    @abc.abstractmethod
    async def release(self, remaining_s: float) -> None:
        """Let go of subscriptions, threads and servers; remaining_s is what is left of the grace period
        (for flushing write-behind work)."""

    async def wait_closed(self) -> None:
        """Services that can end on their own (the gateway's HTTP server) override this."""
        await asyncio.Event().wait()


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"),
                        help="NATS server (env NATS_URL; credentials from NATS_CREDS, NATS_USER, NATS_TLS_CA, ...)")
    parser.add_argument("--grace", type=float, default=float(os.environ.get("KVMESH_GRACE_S", DEFAULT_GRACE_S)),
                        help="seconds in-flight work may take to finish on shutdown")
    parser.add_argument("--log-level", default=os.environ.get("KVMESH_LOG_LEVEL", "INFO"))


@dataclass(frozen=True)
class Hosted:
    """A service as a process runs it: its own NATS connection, under its own name and bus identity."""

    service: Service
    conn_name: str
    connect_opts: dict = field(default_factory=dict)  # user / password / inbox_prefix ({}: the environment's)


async def run_service(service: Service, nats_url: str, grace_s: float = DEFAULT_GRACE_S) -> int:
    return await run_services(service.name, [Hosted(service, f"kvmesh-{service.name}")], nats_url, grace_s)


async def run_services(role: str, hosted: list[Hosted], nats_url: str, grace_s: float = DEFAULT_GRACE_S) -> int:
    """The lifecycle for one service, or several of one role sharing a process (services/sim_pack.py)."""
    setup_tracing(f"kvmesh-{role}")
    label = role if len(hosted) == 1 else f"{len(hosted)} {role} workers"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    conns: list[Client] = []
    try:
        for h in hosted:  # one after the other: each is a worker the gateway may route to once its beat comes
            nc = await bus.connect(nats_url, name=h.conn_name, **h.connect_opts)
            conns.append(nc)
            await h.service.start(nc)
        log.info("%s serving on %s", label, nats_url)
        freeze_startup_heap()
        closed = [asyncio.ensure_future(h.service.wait_closed()) for h in hosted]
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({*closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for f in (*closed, stopping):
            f.cancel()
        log.info("%s draining (grace %.1fs)", label, grace_s)
        await asyncio.wait_for(asyncio.gather(*(h.service.drain(grace_s) for h in hosted)), timeout=grace_s + 5)
        # A service that failed on its own (in a pack: any one of them) ends the process non-zero, so a
        # supervisor restarts it; the gateway moves the other workers' requests meanwhile.
        failed = [f for f in done if f is not stopping and not f.cancelled() and f.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
    finally:
        await asyncio.gather(*(_drain_connection(nc) for nc in conns))
    log.info("%s stopped", label)
    return 0


def freeze_startup_heap() -> None:
    """What a service has built by the time it serves (an engine's modules, a tokenizer's tables, imported
    libraries: about 340,000 objects in an engine worker) lives as long as the process. Left to the collector,
    every full collection walks all of it while holding the GIL: 240 ms for an engine worker's heap, and under
    200 requests of load the decode worker and the gateway each stalled 60-150 ms in one. Frozen, full
    collections walk only what came after (none reached that size in the same load); vLLM freezes its engine's
    heap after startup for the same reason."""
    gc.collect()
    gc.freeze()


async def _drain_connection(nc: Client) -> None:
    try:
        await asyncio.wait_for(nc.drain(), timeout=5)
    except Exception:  # noqa: BLE001 - a broken connection must not turn a clean stop into a crash
        log.warning("NATS drain did not finish cleanly", exc_info=True)


def service_parser(name: str, add_arguments) -> argparse.ArgumentParser:
    """The flags of `kvmesh serve <name>`: the common ones, then the service's (also read by
    docs/gen_cli_reference.py, so the CLI reference is this parser)."""
    parser = argparse.ArgumentParser(prog=f"kvmesh serve {name}")
    add_common_arguments(parser)
    add_arguments(parser)
    return parser


def main_for(name: str, add_arguments, build, argv: list[str] | None = None) -> int:
    """Entry point shared by `python -m services.<name>` and `kvmesh serve <name>`.

    add_arguments(parser) adds the service's flags; build(args) returns the Service.
    """
    args = service_parser(name, add_arguments).parse_args(argv)
    if getattr(args, "model", None):  # a .gguf (or a directory holding one) -> its cached checkpoint dir
        from shared.models.model_source import resolve_model

        args.model = resolve_model(args.model)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_service(build(args), args.nats_url, args.grace))
    except (MemoryBudgetError, ConfigError) as e:
        # A configuration that cannot fit fails the same way on every restart: say so, and exit with
        # EX_CONFIG so the launcher does not retry it.
        print(f"kvmesh {name}: cannot start: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
