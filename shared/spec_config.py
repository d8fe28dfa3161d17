"""`--speculative-config`: which proposer drafts tokens for the verify step, as vLLM's JSON keys.

Parsed here, once, at start: a bad JSON text, an unknown method or key, or a draft length below 1 is a
ConfigError (a worker restarted with it would fail the same way), never a silently ignored field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

from shared.engine.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # k: the most tokens drafted for one request in one step
    # ngram (prompt lookup): the longest, then shorter, suffix of the context that occurred before.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # suffix: context length the count tables key on, how many finished outputs the worker-wide table keeps,
    # and the least empirical probability of a drafted run (the product over its tokens): the draft stops below.
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_spec_factor: float = 1.0  # a draft is at most this many times the matched suffix's length
    # No speculation in a step whose running decode batch is larger than this (0: never switch off): at a large
    # batch the verify forward's extra rows cost more than the accepted tokens save (vLLM's key of the name).
    disable_by_batch_size: int = 8
    # draft_model: the small checkpoint (directory or .gguf) with the target's tokenizer that drafts; loaded with
    # the project's own loader on the target's device and dtype (shared/engine/spec/draft_model.py).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            hint = " (EAGLE heads are not built yet)" if self.method == "eagle" else ""
            raise ConfigError(f"--speculative-config: unknown method {self.method!r}{hint}; "
                              f"choose one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--speculative-config: {name} must be an integer >= 1, got {value!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model.strip()):
            raise ConfigError('--speculative-config: method "draft_model" needs "model": the draft checkpoint')
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError(f'--speculative-config: "model" is only for method "draft_model", not {self.method!r}')
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ConfigError("--speculative-config: disable_by_batch_size must be an integer >= 0 (0: never)")
        f = self.suffix_decoding_max_spec_factor
        if not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 0:
            raise ConfigError(f"--speculative-config: suffix_decoding_max_spec_factor must be > 0, got {f!r}")
        p = self.suffix_decoding_min_token_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
            raise ConfigError(f"--speculative-config: suffix_decoding_min_token_prob must be in [0, 1], got {p!r}")

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """The flag's JSON object; None or "" (the flag left out): no speculation."""
        if text is None or not text.strip():
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--speculative-config is not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"--speculative-config must be a JSON object, got {type(raw).__name__}")
        if "method" not in raw:
            raise ConfigError(f"--speculative-config needs a \"method\" ({', '.join(METHODS)})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**raw)

    def to_json(self) -> str:
        """The flag's text for a child process (kvmesh up passes it to decode workers)."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))
