"""Connecting to NATS from the environment."""
from __future__ import annotations

import logging
import os
import ssl
from typing import Any

import nats
from nats.aio.client import Client

from shared.bus import slow_consumer
from shared.bus.roles import ENGINE_ROLES, ROLES, inbox_prefix

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"


async def connect(url: str | None = None, **opts: Any) -> Client:
    """Connects to NATS; explicit arguments win over the environment.

    Environment variables:
      NATS_URL       server URL(s), comma separated (default nats://127.0.0.1:4222);
                     may embed user:password@ or a token@. With several (a NATS cluster) the client
                     fails over to another when its server goes away, and learns the cluster's
                     other servers from the one it is connected to.
      NATS_NO_RANDOMIZE  1: try the servers in the order given (the first is this process's home
                     server; `kvmesh up` rotates the list to spread services). Default: nats-py's
                     random order, which spreads scaled replicas (compose).
      NATS_USER, NATS_PASSWORD   username/password authentication; a kvmesh role name or an engine replica's
                     user (decode-2; shared/bus/roles.py) also sets the inbox prefix its permissions allow
      NATS_INBOX_PREFIX  this identity's inboxes (`kvmesh up` gives each process its own user, which may
                     read only `_INBOX.<user>.>`)
      NATS_TOKEN     token authentication
      NATS_CREDS     path of a .creds file (user JWT + nkey seed, decentralized auth)
      NATS_NKEY      path of an nkey seed file (nkey authentication without a JWT)
      NATS_TLS_CA    CA bundle used to verify the server (enables TLS)
      NATS_TLS_CERT, NATS_TLS_KEY   client certificate and key for mutual TLS

    `opts` go straight to nats.connect (name, max_reconnect_attempts, error_cb, ...).
    """
    env = os.environ
    servers = [s.strip() for s in (url or env.get("NATS_URL") or DEFAULT_URL).split(",") if s.strip()]
    kwargs: dict[str, Any] = {"servers": servers}
    if env.get("NATS_NO_RANDOMIZE", "").lower() in ("1", "true", "yes"):
        kwargs["dont_randomize"] = True
    if env.get("NATS_USER"):
        kwargs["user"] = env["NATS_USER"]
        kwargs["password"] = env.get("NATS_PASSWORD", "")
        # A locked-down mesh: a role's user, or an engine replica's (compose's decode-2), reads only its own inboxes.
        if env["NATS_USER"] in ROLES or env["NATS_USER"].rsplit("-", 1)[0] in ENGINE_ROLES:
            kwargs["inbox_prefix"] = inbox_prefix(env["NATS_USER"])
    if env.get("NATS_INBOX_PREFIX"):
        kwargs["inbox_prefix"] = env["NATS_INBOX_PREFIX"]
    if env.get("NATS_TOKEN"):
        kwargs["token"] = env["NATS_TOKEN"]
    if env.get("NATS_CREDS"):
        kwargs["user_credentials"] = env["NATS_CREDS"]
    if env.get("NATS_NKEY"):
        kwargs["nkeys_seed"] = env["NATS_NKEY"]
    tls = _tls_context(env.get("NATS_TLS_CA"), env.get("NATS_TLS_CERT"), env.get("NATS_TLS_KEY"))
    if tls is not None:
        kwargs["tls"] = tls
    kwargs.update(opts)
    report = opts.get("error_cb") or _log_error

    async def on_error(e: Exception) -> None:
        slow_consumer.note(e)  # a stream that lost messages this way fails at once (shared/bus/stream.py)
        await report(e)

    kwargs["error_cb"] = on_error
    return await nats.connect(**kwargs)


def _tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not (ca or cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    if cert:
        ctx.load_cert_chain(certfile=cert, keyfile=key or None)
    return ctx


async def _log_error(e: Exception) -> None:
    # nats-py's default prints a full traceback for every failed reconnect attempt.
    log.warning("nats: %s: %s", type(e).__name__, e)
