"""Request bodies for /v1/completions and /v1/chat/completions."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from .datasets import Prompt


class EosMode(str, Enum):
    """How outputs are forced to their requested length.

    ignore_eos: the vLLM/SGLang/TGI extension field `ignore_eos: true`.
    hf_generation_config: transformers serve rejects unknown fields (422) but takes a
        `generation_config` JSON string; per-request `eos_token_id: -1` never matches a token.
    off: send nothing; outputs may stop early and the report counts the short ones.
    """

    IGNORE_EOS = "ignore_eos"
    HF_GENERATION_CONFIG = "hf_generation_config"
    OFF = "off"


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    chat: bool = False
    stream: bool = True
    api_key: str | None = None
    temperature: float = 0.0
    eos_mode: EosMode = EosMode.IGNORE_EOS
    extra_body: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if self.chat else "/completions")

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def build_body(ep: Endpoint, prompt: Prompt, history: list[Message], max_tokens: int) -> dict:
    """history: earlier turns of a multi-turn conversation (empty for single-shot)."""
    body: dict = {"model": ep.model.split(",")[0], "max_tokens": max_tokens, "temperature": ep.temperature, "stream": ep.stream}
    if ep.stream:
        # vLLM and SGLang only put usage in the stream when asked; others ignore the field.
        body["stream_options"] = {"include_usage": True}
    if ep.chat:
        assert isinstance(prompt, str), "chat completions take text prompts"
        msgs = [{"role": m.role, "content": m.content} for m in history]
        body["messages"] = msgs + [{"role": "user", "content": prompt}]
    elif history:
        assert isinstance(prompt, str)
        body["prompt"] = "".join(f"{m.role}: {m.content}\n" for m in history) + f"user: {prompt}\nassistant:"
    else:
        body["prompt"] = prompt
    if ep.eos_mode is EosMode.IGNORE_EOS:
        body["ignore_eos"] = True
    elif ep.eos_mode is EosMode.HF_GENERATION_CONFIG:
        body["generation_config"] = json.dumps({"eos_token_id": -1, "max_new_tokens": max_tokens})
    body.update(ep.extra_body)
    return body
