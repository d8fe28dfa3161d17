"""decode workers -> routers (fan-out): what each worker caches and how busy it is."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from shared.wire import Message

# A beat's strings and lists are bounded: the gateway keeps the latest beat of every worker and renders them
# all in /metrics, and the planner parses them.
MAX_NAME = 256  # a worker id, an adapter's name, an endpoint
MAX_ADAPTERS = 4096  # LoRA adapters a worker names in one beat
MAX_DRAFT_POSITIONS = 64  # draft positions a beat counts acceptances of (a worker drafting more sends the first 64)
Name = Annotated[str, Field(max_length=MAX_NAME)]


class BlockStored(Message):
    """Full blocks newly cached, as a chain: hashes[0]'s parent is `parent` (None at the root).

    The one block-event pair of the mesh: a worker publishes its engine's events
    (shared/engine/block_events.py) as these, with its id; the kvstore publishes its own."""

    KIND: ClassVar[str] = "event.block_stored"

    worker_id: str = ""
    hashes: list[bytes]
    parent: bytes | None = None
    # Where the blocks now are: "device" (the worker's KV pool), "host" (its host tier) or "kvstore"
    # (published by the kvstore, worker_id "kvstore"). Host and kvstore events carry no chain (parent None).
    tier: str = "device"


class BlockRemoved(Message):
    """Cached blocks given up (a worker's device pool or host tier, or the kvstore)."""

    KIND: ClassVar[str] = "event.block_removed"

    worker_id: str = ""
    hashes: list[bytes]
    tier: str = "device"


BlockEvent = BlockStored | BlockRemoved


class LoadBeat(Message):
    """A worker's state: sent once per beat interval and, debounced, as soon as its requests or KV usage
    change, so gauges built from it lag the engine by well under 100 ms. Counters are cumulative since
    the worker started (a restart resets them, which Prometheus' rate() handles)."""

    KIND: ClassVar[str] = "event.load"

    worker_id: str = Field(max_length=MAX_NAME)
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    # What a router needs to hash prompts the way this worker does (shared/block_hash.py).
    block_size: int = 16
    hash_root: bytes = Field(default=b"", max_length=64)
    max_model_len: int = 0
    role: str = Field(default="decode", max_length=16)  # "decode" | "prefill"
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up (own prefix cache, then the kvstore)
    prefix_cache_hits: int = 0  # prompt tokens found in either
    # Tokens computed per engine step: per-bucket counts (last = +Inf) over `iteration_token_buckets`, and the sum.
    # (Lists bounded: a worker's own beat is rendered by /metrics and parsed by the planner.)
    iteration_token_buckets: list[int] = Field(default_factory=list, max_length=64)
    iteration_token_counts: list[int] = Field(default_factory=list, max_length=65)
    iteration_tokens_sum: int = 0
    kv_cache_dtype: str = Field(default="", max_length=MAX_NAME)
    offloaded_blocks: int = 0  # blocks handed to the kvstore (cumulative)
    offload_dropped_blocks: int = 0  # blocks not offloaded under backpressure (cumulative; never a request)
    # Prompt tokens loaded per tier below the device (cumulative), and the host tier's size now.
    host_tier_hit_tokens: int = 0
    kvstore_hit_tokens: int = 0
    host_tier_bytes: int = 0
    kv_endpoint: str = Field(default="", max_length=MAX_NAME)  # the worker's direct KV channel (tcp://host:port), "" when KV comes over NATS only
    # A prefill worker's KV pushes (cumulative): how many, their bytes, and the seconds decode workers
    # waited on them after the prompt's last chunk computed (the part of a push no compute hid).
    # Speculative decoding (cumulative; vLLM's spec_decode counters): verifies with drafts, drafted tokens,
    # accepted tokens, and per draft position how often its token was accepted.
    spec_num_drafts: int = Field(default=0, ge=0)
    spec_num_draft_tokens: int = Field(default=0, ge=0)
    spec_num_accepted_tokens: int = Field(default=0, ge=0)
    spec_num_accepted_tokens_per_pos: list[int] = Field(default_factory=list, max_length=MAX_DRAFT_POSITIONS)
    # How the engine ran those verify steps (cumulative; shared/engine/verify_graphs.py): replayed from a captured
    # CUDA graph, through the graphs' padded path run eagerly (capture off), or on the runner's eager path (no
    # bucket fits, a prompt chunk in the step, tensor parallel).
    spec_verify_graph_replays: int = Field(default=0, ge=0)
    spec_verify_padded_eager: int = Field(default=0, ge=0)
    spec_verify_eager: int = Field(default=0, ge=0)
    kv_pushes: int = Field(default=0, ge=0)
    kv_push_bytes: int = Field(default=0, ge=0)
    kv_push_wait_seconds: float = Field(default=0.0, ge=0)
    # Engine seconds spent handing a prefill's KV out (gathering whole blocks from the ranks, or each rank sending
    # its heads to its decode rank): the part of a push inside the engine's steps (cumulative).
    kv_handout_seconds: float = Field(default=0.0, ge=0)
    # Times the worker's NATS connection reconnected. On a locked-down bus a process may answer a request
    # only on the connection that received it, so a worker that moved to another server can no longer
    # stream the requests it already had: the gateway resumes them elsewhere when this grows.
    bus_reconnects: int = Field(default=0, ge=0)
    # Drawn once per worker process: a worker restarted under the same id (its supervisor's restart) beats with
    # another, so the gateway knows the streams it had are gone even when the restart beat the beats' expiry.
    # "": unknown (no such check).
    incarnation: str = Field(default="", max_length=64)
    # A decode worker's replays (cumulative; services/decode/replay.py): chunks a gateway lost over a reconnect and
    # asked again, answered from the worker's recent chunks (served) or no longer kept (misses: it migrated).
    stream_replays: int = Field(default=0, ge=0)
    stream_replay_misses: int = Field(default=0, ge=0)
    # The LoRA adapters this worker holds, by name (the router prefers a worker holding a request's adapter).
    lora_adapters: list[Name] = Field(default_factory=list, max_length=MAX_ADAPTERS)
    # ... and those of them in its device slots or host cache: a request for one starts without reading it from disk.
    lora_resident: list[Name] = Field(default_factory=list, max_length=MAX_ADAPTERS)
