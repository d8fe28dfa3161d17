"""The gateway's flags that `kvmesh up` passes through are one table (shared/gateway_flags.py): what the launcher
parses reaches the gateway's parser as the same value, nothing given forwards nothing, and the gateway's parsed
defaults are its config's defaults."""
from __future__ import annotations

import argparse

from services.gateway import service as gateway
from services.gateway.config import GatewayConfig
from shared.gateway_flags import GATEWAY_FLAGS
from shared.launcher import up
from shared.launcher.process_spec import MeshOptions, mesh_services

GIVEN = {"--routing": "round-robin", "--scheduling-policy": "priority", "--trust-request-chat-template": None,
         "--trusted-hosts": "a.example,b.example", "--max-inflight-requests": "7", "--max-queue-wait": "12.5",
         "--max-request-tokens": "9000", "--stream-write-timeout": "3.25"}


def _parser(add) -> argparse.ArgumentParser:  # noqa: ANN001
    p = argparse.ArgumentParser()
    add(p)
    return p


def _gateway_args(opts: MeshOptions) -> list[str]:
    return list({s.service: s.args for s in mesh_services(opts)}["gateway"])


def _mesh_options(args: argparse.Namespace) -> MeshOptions:
    return MeshOptions(model="m", **{f.dest: getattr(args, f.dest) for f in GATEWAY_FLAGS})


def test_every_flag_given_to_kvmesh_up_reaches_the_gateway_unchanged() -> None:
    assert set(GIVEN) == {f.flag for f in GATEWAY_FLAGS}
    argv = [a for flag, value in GIVEN.items() for a in ([flag] if value is None else [flag, value])]
    launched = _parser(up.add_arguments).parse_args(["--model", "m", *argv])
    forwarded = _gateway_args(_mesh_options(launched))
    parsed = _parser(gateway.add_arguments).parse_args(["--model", "m", *forwarded])
    for f in GATEWAY_FLAGS:
        assert getattr(parsed, f.dest) == getattr(launched, f.dest) not in (None, False), f.flag


def test_nothing_given_forwards_nothing_and_the_gateway_keeps_its_defaults() -> None:
    launched = _parser(up.add_arguments).parse_args(["--model", "m"])
    forwarded = _gateway_args(_mesh_options(launched))
    assert not {f.flag for f in GATEWAY_FLAGS} & set(forwarded)
    parsed = _parser(gateway.add_arguments).parse_args(["--model", "m", *forwarded])
    defaults = {"routing": GatewayConfig.routing, "scheduling_policy": GatewayConfig.scheduling_policy,
                "trust_request_chat_template": GatewayConfig.trust_request_chat_template,
                "trusted_hosts": GatewayConfig.trusted_hosts,
                "max_inflight_requests": GatewayConfig.max_inflight_requests,
                "max_queue_wait": GatewayConfig.max_queue_wait_s,
                "max_request_tokens": GatewayConfig.max_request_tokens,
                "stream_write_timeout": GatewayConfig.stream_write_timeout_s}
    assert {f.dest: getattr(parsed, f.dest) for f in GATEWAY_FLAGS} == defaults
