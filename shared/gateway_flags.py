"""The gateway's flags that `kvmesh up` takes too: one table for the gateway's parser, the launcher's parser and
the launcher's forwarding, so a flag, its help and its default are written once.

The gateway parses them with their defaults; the launcher parses them with None (or False), so it forwards only
what the user gave and the gateway's own default stays the one default. The launcher's options carry each value
under the flag's dest (shared/launcher/process_spec.py MeshOptions)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROUTING = ("kv", "round-robin")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class GatewayFlag:
    flag: str
    default: Any  # the gateway's
    help: str
    type: Callable[[str], Any] | None = None  # None: a switch (store_true)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def argv(self, value: Any) -> list[str]:  # noqa: ANN401
        """The gateway's arguments for a launcher value (None or False: nothing, the gateway's default)."""
        if value is None or value is False:
            return []
        if self.type is None:
            return [self.flag]
        return [self.flag, f"{value:g}" if isinstance(value, float) else str(value)]


GATEWAY_FLAGS = (
    GatewayFlag("--routing", "kv", "kv: the decode worker caching most of the prompt, weighed by load; round-robin: "
                "each alive worker in turn, blind to caches (a baseline)", str, ROUTING),
    GatewayFlag("--scheduling-policy", "fcfs", "fcfs: a request's priority other than 0 is a 400; priority: requests "
                "with a higher priority are served first (vLLM's rule)", str, SCHEDULING_POLICIES),
    GatewayFlag("--trust-request-chat-template", False, "let a request bring its own chat_template (rendered in a "
                "separate process with CPU, memory and output limits); default: such a request is a 400, as vLLM"),
    GatewayFlag("--trusted-hosts", None, "comma-separated host names the Host header may name, against DNS "
                "rebinding ('*': any; default: localhost, 127.0.0.1 and ::1 when bound to loopback, any otherwise)",
                str, metavar="NAMES"),
    GatewayFlag("--max-inflight-requests", 1024, "generation requests the gateway serves at once; past it a new one "
                "gets 429 with Retry-After at once (0: no bound)", int, metavar="N"),
    GatewayFlag("--max-queue-wait", 30.0, "longest a request may wait for its first token: a new request the mesh is "
                "expected not to start in time (its requests waiting / the rate it starts them) gets 429 with "
                "Retry-After, one that has not started by then 503 and its workers drop it (0: off)", float,
                metavar="SECONDS"),
    GatewayFlag("--max-request-tokens", None, "tokens of work one request may ask (its prompts plus n, best_of or "
                "beams x max_tokens); past it a 400 (default: 16 context lengths)", int, metavar="TOKENS"),
    GatewayFlag("--stream-write-timeout", 30.0, "longest wait for one write to a streaming client; past it the stream "
                "ends and its worker drops the request", float, metavar="SECONDS"),
)
DEFAULTS = {f.dest: f.default for f in GATEWAY_FLAGS}


def add_gateway_flags(parser: argparse.ArgumentParser, launcher: bool) -> None:
    """The table's flags on a parser: the gateway's (launcher False) with their defaults, or `kvmesh up`'s (True)
    with None, saying what the gateway's default is."""
    prefix = "[gateway] " if launcher else ""
    for f in GATEWAY_FLAGS:
        if f.type is None:
            parser.add_argument(f.flag, action="store_true", help=prefix + f.help)
            continue
        shown = f" (default: {f.default})" if f.default is not None and "default" not in f.help else ""
        parser.add_argument(f.flag, type=f.type, choices=f.choices, metavar=f.metavar,
                            default=None if launcher else f.default, help=prefix + f.help + shown)


def gateway_argv(values: Any) -> list[str]:  # noqa: ANN401
    """The gateway's arguments for the table's values on `values` (attributes named by each flag's dest)."""
    return [a for f in GATEWAY_FLAGS for a in f.argv(getattr(values, f.dest))]
