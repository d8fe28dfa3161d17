"""Per-request sampling settings: one type, validated once at construction, that crosses the wire as is.

The gateway builds it from the HTTP request (services/gateway/sampling.py, the one mapping), it travels
inside GenerateRequest / PrefillRequest as msgpack, and the engine samples with it. It sits just above
the wire codec and below both the engine and the protocol, and never imports torch.
"""
from __future__ import annotations

import json

from pydantic import Field, field_serializer, field_validator, model_validator

from shared.wire import WireModel

MAX_TOP_LOGPROBS = 20
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Compiling a constraint costs time that grows with its size, and for JSON schemas about cubically with their
# nesting (xgrammar 0.2.8 on 2 cores: 0.06 s at 32 nested objects, 0.5 s at 64, 5 s at 200): both are bounded so
# that one request's compile stays well under a second. JSON depth counts objects and arrays alike, so a schema's
# "properties" level counts too: 64 is 32 nested objects.
MAX_STRUCTURED_SPEC_CHARS = 64 << 10
MAX_SCHEMA_DEPTH = 64


def json_depth(value: object) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, d)
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


class StructuredOutput(WireModel):
    """A constraint on the output, enforced by token masks while decoding (shared/engine/grammar.py).

    kind: json_object (any JSON object), json_schema (spec: the schema as JSON text), regex (spec: the
    pattern), choice (spec: a JSON list of the allowed strings), grammar (spec: EBNF, xgrammar's dialect).
    """

    kind: str
    spec: str = ""

    @model_validator(mode="after")
    def _valid(self) -> StructuredOutput:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured output {self.kind} needs a specification")
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"the structured output's {self.kind} is {len(self.spec)} characters long, more than the "
                             f"{MAX_STRUCTURED_SPEC_CHARS} allowed")
        if self.kind in ("json_schema", "choice"):
            try:
                depth = json_depth(json.loads(self.spec))
            except RecursionError:
                depth = MAX_SCHEMA_DEPTH + 1
            except ValueError:
                return self  # not JSON: the grammar backend names the problem
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the structured output's {self.kind} nests {depth} levels deep, more than the "
                                 f"{MAX_SCHEMA_DEPTH} allowed (objects and arrays each count a level)")
        return self


class SamplingParams(WireModel):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (-1 is stored as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; n: plus top-n
    # Added to the logits before anything else, as OpenAI's logit_bias (token id -> bias in [-100, 100]).
    # Keys are ints everywhere in Python; only the msgpack encoding writes them as strings (the wire
    # takes string map keys only), and decoding turns them back.
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: every other token is masked out.
    allowed_token_ids: list[int] | None = None
    structured: StructuredOutput | None = None
    # vLLM's prompt_logprobs: the logprob of every prompt token after the first (and the top-n), as
    # completions' echo with logprobs reports them. Such a request skips the prefix cache (cached
    # blocks have no logits) and is prefilled locally.
    prompt_logprobs: int | None = None
    # A reasoning model's end-of-thinking marker (`</think>`) as token ids: `structured` applies only after the
    # output has written them, so the model reasons freely first (vLLM's reasoning-aware structured outputs).
    # None: the constraint applies from the first token.
    reasoning_end_ids: list[int] | None = None
    # vLLM's bad_words, tokenized by the gateway: each a token-id sequence the output must never complete
    # (its last token is masked whenever the output ends with the others).
    bad_words_ids: list[list[int]] | None = None
    # Per-request prefix-cache isolation (vLLM's cache_salt): folded into the first block's hash, so every
    # tier (device, host, kvstore) keys this request's blocks apart from other salts' and unsalted ones.
    cache_salt: str | None = None
    # The LoRA adapter to compute with, by its served name (None: the base model). Prefill and decode workers
    # resolve it in their own registry; its digest enters the block hashes (shared/block_hash.py lora_root).
    lora_name: str | None = None
    # Output shaping, applied where text is made (the gateway's detokenizer and stop matcher): keep the
    # stop string or stop token's text (vLLM's include_stop_str_in_output, SGLang's no_stop_trim);
    # special tokens' text; with it kept, false writes adjacent special tokens bare (vLLM's rule,
    # services/gateway/special_tokens.py).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _int_keys(cls, v: object) -> object:
        if not isinstance(v, dict):
            return v
        out = {}
        for k, b in v.items():
            if isinstance(k, str) and k.lstrip("-").isdigit():
                k = int(k)
            if type(k) is not int:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            out[k] = b
        return out

    @field_serializer("logit_bias")
    def _string_keys(self, v: dict[int, float] | None) -> dict[str, float] | None:
        return None if v is None else {str(k): b for k, b in v.items()}

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {v}")
        return 0 if v == -1 else v

    @model_validator(mode="after")
    def _valid(self) -> SamplingParams:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
        if self.logit_bias is not None:
            bad = next((v for v in self.logit_bias.values() if not -100 <= v <= 100), None)
            if bad is not None:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.bad_words_ids is not None and any(not w for w in self.bad_words_ids):
            raise ValueError("bad_words_ids must not hold an empty word")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must not be empty")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def token_ids_named(self) -> list[int]:
        """Every token id these settings name (the engine checks them against the vocabulary)."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or []),
                *(self.reasoning_end_ids or []), *(t for w in self.bad_words_ids or [] for t in w)]

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
