"""Every NATS subject and queue group kvmesh uses, in one place.

Subjects follow `kvmesh.<service>.<endpoint>`. Endpoints served by a pool of interchangeable
workers use a queue group (NATS hands each message to one member); fan-out subjects (events,
load beats, cancels) have none, so every subscriber sees every message. Per-worker subjects end
in the worker id, which must be a single subject token.
"""
from __future__ import annotations

import re

PREFIX = "kvmesh"

# nats.micro service names (`$SRV.PING.<name>`); also the OpenTelemetry service.name.
SERVICE_GATEWAY = "kvmesh-gateway"
SERVICE_TOKENIZER = "kvmesh-tokenizer"
SERVICE_DECODE = "kvmesh-decode"
SERVICE_PREFILL = "kvmesh-prefill"
SERVICE_KVSTORE = "kvmesh-kvstore"

# --- tokenizer: stateless, load balanced
TOKENIZER_ENCODE = "kvmesh.tokenizer.encode"
TOKENIZER_DECODE = "kvmesh.tokenizer.decode"
QUEUE_TOKENIZER = "kvmesh.tokenizer"

# --- decode
# Any decode worker (used when the router has no affinity information yet).
DECODE_GENERATE = "kvmesh.decode.generate"
QUEUE_DECODE = "kvmesh.decode"
# Cancels fan out: only the worker holding the request acts, the others ignore it.
DECODE_CANCEL = "kvmesh.decode.cancel"
DECODE_EVENTS_ALL = "kvmesh.decode.events.*"
DECODE_LOAD_ALL = "kvmesh.decode.load.*"
# Finished outputs for the other decode workers' suffix tables (fan-out; services/decode/suffix_sharing.py).
DECODE_SUFFIX_ALL = "kvmesh.decode.suffix.*"

# --- prefill
PREFILL_PREFILL = "kvmesh.prefill.prefill"
QUEUE_PREFILL = "kvmesh.prefill"
PREFILL_CANCEL = "kvmesh.prefill.cancel"  # fan-out, like DECODE_CANCEL
PREFILL_LOAD_ALL = "kvmesh.prefill.load.*"

# --- kvstore: any replica may answer (they share the disk tier)
KVSTORE_PUT = "kvmesh.kvstore.put"
KVSTORE_GET = "kvmesh.kvstore.get"
KVSTORE_CONTAINS = "kvmesh.kvstore.contains"
KVSTORE_STATS = "kvmesh.kvstore.stats"
KVSTORE_EVENTS = "kvmesh.kvstore.events"  # BlockStored(tier="kvstore") after puts, for routers
QUEUE_KVSTORE = "kvmesh.kvstore"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def worker_token(worker_id: str) -> str:
    """Checks that a worker id is usable as one subject token (no dots, spaces or wildcards)."""
    if not isinstance(worker_id, str) or not _TOKEN.match(worker_id):
        raise ValueError(f"worker id must match {_TOKEN.pattern}, got {worker_id!r}")
    return worker_id


def decode_generate(worker_id: str) -> str:
    """Generate requests routed by the gateway to one decode worker (cache affinity)."""
    return f"kvmesh.decode.generate.{worker_token(worker_id)}"


def lora_update(worker_id: str) -> str:
    """LoRA adapter loads and unloads for one engine worker, decode or prefill (shared/protocol/lora.py)."""
    return f"kvmesh.lora.update.{worker_token(worker_id)}"


def decode_replay(worker_id: str) -> str:
    """Replay requests for the streams one decode worker serves (services/decode/replay.py)."""
    return f"kvmesh.decode.replay.{worker_token(worker_id)}"


def decode_kv_push(worker_id: str) -> str:
    """Inbox where prefill workers push KV blocks for one decode worker."""
    return f"kvmesh.decode.kv.push.{worker_token(worker_id)}"


def decode_events(worker_id: str) -> str:
    """BlockStored / BlockRemoved events of one decode worker (ordered, fan-out)."""
    return f"kvmesh.decode.events.{worker_token(worker_id)}"


def decode_suffix(worker_id: str) -> str:
    """Finished outputs one decode worker shares with the others (fan-out)."""
    return f"kvmesh.decode.suffix.{worker_token(worker_id)}"


def decode_load(worker_id: str) -> str:
    """Periodic LoadBeat of one decode worker (fan-out)."""
    return f"kvmesh.decode.load.{worker_token(worker_id)}"


def prefill_load(worker_id: str) -> str:
    """LoadBeat of one prefill worker (fan-out; the gateway reads it for metrics, never for routing)."""
    return f"kvmesh.prefill.load.{worker_token(worker_id)}"


def worker_from_subject(subject: str) -> str:
    """The worker id at the end of a per-worker subject (events, load beats, pushes)."""
    return worker_token(subject.rsplit(".", 1)[-1])
