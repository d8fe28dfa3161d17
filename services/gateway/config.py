"""The gateway's settings, from its flags (and KVMESH_API_KEY)."""
from __future__ import annotations

from dataclasses import dataclass

from shared.gateway_flags import DEFAULTS, ROUTING, SCHEDULING_POLICIES
from shared.models.pooling_config import PoolingSpec


@dataclass(frozen=True)
class ModelEntry:
    """One served model: its checkpoint (tokenizer + config.json), the name clients use, and the subject
    namespace of its tokenizer and workers (shared/subjects.py model_namespace)."""

    model_dir: str
    served_model_name: str
    namespace: str = ""


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str  # the first (default) model's
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (tests)
    # Generation requests served at once; past it a new one gets a fast 429 (services/gateway/overload.py).
    # 0: no bound. 1,024 streams at ~1 token/10 ms each already ask ~0.5 of a core of the gateway.
    max_inflight_requests: int = DEFAULTS["max_inflight_requests"]
    # ... and while its own NATS input lags more than this (services/gateway/input_lag.py), whatever the count:
    # the bound that follows the machine. 0: off.
    max_input_lag_s: float = 0.5
    # Longest a request may wait for its first token (services/gateway/queue_wait.py): a new one the mesh is
    # expected not to start in time gets a 429 with Retry-After, one sent that has not started by then a 503 (its
    # workers drop it). 0: no bound (requests queue in the engines for as long as it takes).
    max_queue_wait_s: float = DEFAULTS["max_queue_wait"]
    max_waiting: int = 128  # per decode worker, from its load beats; at the bound it takes no new work
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    # Absent max_tokens: this many, capped by what is left of the context; 0 means "the rest of the
    # context" (vLLM's rule), which on a large context can run for a long time.
    default_max_tokens: int = 256
    api_key: str | None = None  # when set, every path but /health, /metrics, /version needs `Authorization: Bearer <key>`
    max_body_bytes: int | None = None  # request body limit (413 above); default: 1 MiB + 64 bytes per context token
    # Tokens of work one request may ask (prompts + n/best_of/beams x max_tokens, services/gateway/overload.py);
    # None: 16 context lengths.
    max_request_tokens: int | None = None
    # Host header names served (any port), against DNS rebinding; None: loopback names when bound to loopback,
    # any otherwise (intake.default_trusted_hosts); ("*",): any.
    trusted_hosts: tuple[str, ...] | None = None
    # vLLM's --scheduling-policy: "fcfs" refuses a request's priority other than 0; "priority" honours it.
    scheduling_policy: str = DEFAULTS["scheduling_policy"]
    # vLLM's --trust-request-chat-template: a request may bring its own chat template (rendered in a separate,
    # limited process: services/tokenizer/template_sandbox.py). Off: such a request is a 400.
    trust_request_chat_template: bool = False
    tokenizer_timeout_s: float = 10.0
    stream_idle_timeout_s: float = 120.0  # longest silence from a decode worker (covers a long prefill)
    # Token messages one stream's inbox holds unread before NATS' client drops them and the stream ends with a
    # 503 error event (the gateway fell behind, or its client stopped reading). None: nats-py's default (512 Ki).
    stream_pending_msgs: int | None = 4096
    # Longest wait for one write to a streaming client; past it the stream ends and the worker drops the request.
    stream_write_timeout_s: float = DEFAULTS["stream_write_timeout"]
    health_timeout_s: float = 1.0
    # A decode worker whose beats stop for this long is dead to the router, and its requests migrate.
    worker_expiry_s: float = 2.0
    # How many times one request may move to another decode worker after its worker died (Dynamo's rule).
    migration_limit: int = 3
    reasoning_parser: str | None = None  # a reasoning.PARSERS name; None: <think> blocks when the template knows them
    tool_call_parser: str | None = None  # a tools.PARSERS name; None: read from the chat template
    # vLLM's structured_outputs_config.enable_in_reasoning: constraints (structured outputs, forced tool calls)
    # cover a reasoning model's <think> text too, instead of starting after it.
    structured_outputs_in_reasoning: bool = False
    # "kv": the worker caching most of the prompt, weighed by load (router.py); "round-robin": the next alive
    # worker in turn, blind to caches (the baseline KV-aware routing is measured against: `kvmesh bench scale`).
    routing: str = DEFAULTS["routing"]
    # The mesh's other models (`--model A --model B`), each on its own workers (services/gateway/served_models.py).
    more_models: tuple[ModelEntry, ...] = ()
    # --runner pooling: the served model embeds or classifies (services/gateway/pooling_api.py); None: it generates.
    pooling: PoolingSpec | None = None
    # LoRA adapters (services/gateway/lora_adapters.py): served at all; loaded at start, (name, path) each; the
    # runtime load/unload API on (services/gateway/lora_routes.py).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    allow_runtime_lora_updating: bool = False

    @property
    def models(self) -> tuple[ModelEntry, ...]:
        """Every served model, the default one first."""
        return (ModelEntry(self.model_dir, self.served_model_name), *self.more_models)

    def __post_init__(self) -> None:
        assert self.scheduling_policy in SCHEDULING_POLICIES, \
            f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
        assert self.routing in ROUTING, f"routing must be one of {', '.join(ROUTING)}"
        assert self.max_waiting > 0, "max_waiting must be positive"
        assert self.max_inflight_requests >= 0, "max_inflight_requests must be 0 (no bound) or positive"
        assert self.max_input_lag_s >= 0, "max_input_lag_s must be 0 (off) or positive"
        assert self.max_queue_wait_s >= 0, "max_queue_wait_s must be 0 (off) or positive"
        assert self.default_max_tokens >= 0
        assert self.migration_limit >= 0
        assert self.max_model_len is None or self.max_model_len > 0
        names = [m.served_model_name for m in self.models]
        assert len(set(names)) == len(names), f"two models served as one name: {', '.join(names)}"
        spaces = [m.namespace for m in self.models]
        assert len(set(spaces)) == len(spaces), "each model needs its own subject namespace"
