"""Every NATS subject and queue group kvmesh uses, in one place.

Subjects follow `kvmesh.<service>.<endpoint>`. Endpoints served by a pool of interchangeable
workers use a queue group (NATS hands each message to one member); fan-out subjects (events,
load beats, cancels) have none, so every subscriber sees every message. Per-worker subjects end
in the worker id, which must be a single subject token.

Several models in one mesh: each model's tokenizer, prefill and decode pools talk on their own subjects,
`kvmesh.<namespace>.<service>.<endpoint>` (`Subjects`), so a queue group never hands one model's request to
another model's worker. The first model keeps the bare `kvmesh.<service>.<endpoint>` (a one-model mesh is
unchanged). Per-worker subjects (a decode worker's generate, replay, KV inbox) and cancels stay shared:
worker ids are unique across the mesh and only the holder of a request acts on its cancel; the kvstore is
shared too (each model's blocks are salted apart). A worker process serves one model: its namespace is
configuration, like NATS_URL, read from NAMESPACE_ENV, and the module's constants below are that namespace's;
the gateway, which serves every model, builds `Subjects(namespace)` per model instead.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

PREFIX = "kvmesh"
NAMESPACE_ENV = "KVMESH_SUBJECT_NAMESPACE"
# A permission (shared/bus/roles.py) that covers every model's namespace but the first (a wildcard token).
ANY_NAMESPACE = "*"

# nats.micro service names (`$SRV.PING.<name>`); also the OpenTelemetry service.name.
SERVICE_GATEWAY = "kvmesh-gateway"
SERVICE_TOKENIZER = "kvmesh-tokenizer"
SERVICE_DECODE = "kvmesh-decode"
SERVICE_PREFILL = "kvmesh-prefill"
SERVICE_KVSTORE = "kvmesh-kvstore"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def worker_token(worker_id: str) -> str:
    """Checks that a worker id is usable as one subject token (no dots, spaces or wildcards)."""
    if not isinstance(worker_id, str) or not _TOKEN.match(worker_id):
        raise ValueError(f"worker id must match {_TOKEN.pattern}, got {worker_id!r}")
    return worker_id


def model_namespace(index: int) -> str:
    """The subject namespace of the mesh's index-th model (`kvmesh up --model` order): "" for the first."""
    assert index >= 0
    return "" if index == 0 else f"m{index}"


@dataclass(frozen=True)
class Subjects:
    """One model's subjects (see the module docstring); namespace "" is the first model's, ANY_NAMESPACE the
    wildcard form every other model's subjects match (for permissions)."""

    namespace: str = ""

    def __post_init__(self) -> None:
        if self.namespace not in ("", ANY_NAMESPACE):
            worker_token(self.namespace)

    def _at(self, rest: str) -> str:
        return f"{PREFIX}.{self.namespace}.{rest}" if self.namespace else f"{PREFIX}.{rest}"

    # --- tokenizer: stateless, load balanced
    @property
    def tokenizer_encode(self) -> str:
        return self._at("tokenizer.encode")

    @property
    def tokenizer_decode(self) -> str:
        return self._at("tokenizer.decode")

    @property
    def queue_tokenizer(self) -> str:
        return self._at("tokenizer")

    # --- decode
    @property
    def decode_generate_any(self) -> str:
        """Any decode worker of the model (used when the router has no affinity information yet)."""
        return self._at("decode.generate")

    @property
    def queue_decode(self) -> str:
        return self._at("decode")

    @property
    def decode_events_all(self) -> str:
        return self._at("decode.events.*")

    @property
    def decode_load_all(self) -> str:
        return self._at("decode.load.*")

    @property
    def decode_suffix_all(self) -> str:
        return self._at("decode.suffix.*")

    def decode_events(self, worker_id: str) -> str:
        return self._at(f"decode.events.{worker_token(worker_id)}")

    def decode_load(self, worker_id: str) -> str:
        return self._at(f"decode.load.{worker_token(worker_id)}")

    def decode_suffix(self, worker_id: str) -> str:
        return self._at(f"decode.suffix.{worker_token(worker_id)}")

    # --- prefill
    @property
    def prefill_prefill(self) -> str:
        return self._at("prefill.prefill")

    @property
    def queue_prefill(self) -> str:
        return self._at("prefill")

    @property
    def prefill_load_all(self) -> str:
        return self._at("prefill.load.*")

    def prefill_load(self, worker_id: str) -> str:
        return self._at(f"prefill.load.{worker_token(worker_id)}")

    @property
    def prefill_pool(self) -> str:
        """A pooling request (embed, classify): answered by a pooling runner's engine worker, in the prefill
        queue group."""
        return self._at("prefill.pool")


# This process's model (a worker serves one; see the module docstring).
CURRENT = Subjects(os.environ.get(NAMESPACE_ENV, ""))

# --- tokenizer: stateless, load balanced
TOKENIZER_ENCODE = CURRENT.tokenizer_encode
TOKENIZER_DECODE = CURRENT.tokenizer_decode
QUEUE_TOKENIZER = CURRENT.queue_tokenizer

# --- decode
# Any decode worker (used when the router has no affinity information yet).
DECODE_GENERATE = CURRENT.decode_generate_any
QUEUE_DECODE = CURRENT.queue_decode
# Cancels fan out: only the worker holding the request acts, the others ignore it.
DECODE_CANCEL = "kvmesh.decode.cancel"
DECODE_EVENTS_ALL = CURRENT.decode_events_all
DECODE_LOAD_ALL = CURRENT.decode_load_all
# Finished outputs for the other decode workers' suffix tables (fan-out; services/decode/suffix_sharing.py).
DECODE_SUFFIX_ALL = CURRENT.decode_suffix_all

# --- prefill
PREFILL_PREFILL = CURRENT.prefill_prefill
QUEUE_PREFILL = CURRENT.queue_prefill
PREFILL_CANCEL = "kvmesh.prefill.cancel"  # fan-out, like DECODE_CANCEL
PREFILL_LOAD_ALL = CURRENT.prefill_load_all
PREFILL_POOL = CURRENT.prefill_pool

# --- kvstore: any replica may answer (they share the disk tier)
KVSTORE_PUT = "kvmesh.kvstore.put"
KVSTORE_GET = "kvmesh.kvstore.get"
KVSTORE_CONTAINS = "kvmesh.kvstore.contains"
KVSTORE_STATS = "kvmesh.kvstore.stats"
KVSTORE_EVENTS = "kvmesh.kvstore.events"  # BlockStored(tier="kvstore") after puts, for routers
QUEUE_KVSTORE = "kvmesh.kvstore"


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
    return CURRENT.decode_events(worker_id)


def decode_suffix(worker_id: str) -> str:
    """Finished outputs one decode worker shares with the others (fan-out)."""
    return CURRENT.decode_suffix(worker_id)


def decode_load(worker_id: str) -> str:
    """Periodic LoadBeat of one decode worker (fan-out)."""
    return CURRENT.decode_load(worker_id)


def prefill_load(worker_id: str) -> str:
    """LoadBeat of one prefill worker (fan-out; the gateway reads it for metrics, never for routing)."""
    return CURRENT.prefill_load(worker_id)


def worker_from_subject(subject: str) -> str:
    """The worker id at the end of a per-worker subject (events, load beats, pushes)."""
    return worker_token(subject.rsplit(".", 1)[-1])
