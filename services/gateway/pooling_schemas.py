"""HTTP bodies of the pooling routes, as vLLM and the OpenAI API define them."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from services.gateway.schemas import _Request

# One string, a list of strings, one token-id list, or a list of token-id lists (OpenAI's `input`).
PoolInput = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
MAX_INPUTS = 2048  # OpenAI's bound on the items of one embeddings request


class _PoolingBody(_Request):
    model: str | None = None
    # Keep only the last k tokens of each input (-1: the model's context); None: an input over the context is a 400.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    add_special_tokens: StrictBool = True
    user: str | None = None


class EmbeddingRequest(_PoolingBody):
    input: PoolInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    normalize: StrictBool | None = None  # vLLM's per-request override of the pooler's normalize


class ClassifyRequest(_PoolingBody):
    input: PoolInput
    activation: StrictBool | None = None  # vLLM's per-request override (softmax/sigmoid or raw logits)


class PoolingRequest(_PoolingBody):
    input: PoolInput
    encoding_format: Literal["float", "base64"] = "float"


class RerankDocument(_Request):
    text: StrictStr


class RerankRequest(_PoolingBody):
    query: StrictStr
    documents: list[StrictStr | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: StrictInt | None = Field(default=None, ge=0)  # None or 0: all of them
    return_documents: StrictBool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class CrossScoreRequest(_PoolingBody):
    """vLLM's /score: text_1 against each of text_2 (one to many), or pairwise (lists of one length)."""

    text_1: StrictStr | list[StrictStr] | None = None
    text_2: StrictStr | list[StrictStr] | None = None
    queries: StrictStr | list[StrictStr] | None = None  # vLLM's newer names for text_1 / text_2
    documents: StrictStr | list[StrictStr] | None = None

    @model_validator(mode="after")
    def _given(self) -> CrossScoreRequest:
        self.text_1 = self.text_1 if self.text_1 is not None else self.queries
        self.text_2 = self.text_2 if self.text_2 is not None else self.documents
        if self.text_1 is None or self.text_2 is None:
            raise ValueError("text_1 and text_2 (or queries and documents) are required")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        one = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        two = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        if not one or not two:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(one) == 1:
            return [(one[0], t) for t in two]
        if len(one) != len(two):
            raise ValueError(f"text_1 has {len(one)} items and text_2 {len(two)}: give one text_1 or as many as text_2")
        return list(zip(one, two))
