"""The one mapping from an HTTP request body to SamplingParams (services/gateway/sampling.py): every
sampling field of the body lands in the one type, and logit_bias keys are ints from there on."""
from __future__ import annotations

import pytest

from services.gateway.errors import APIError
from services.gateway.sampling import sampling_params
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared import wire
from shared.protocol.generate import GenerateRequest
from shared.sampling_params import SamplingParams, StructuredOutput

# A value other than the default for every field the HTTP body maps into SamplingParams.
BODY = dict(
    model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_p=0.9, top_k=7, min_p=0.1,
    seed=11, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, ignore_eos=True, min_tokens=2,
    logit_bias={"5": 3.0, "9": -100}, stop_token_ids=[4], allowed_token_ids=[4, 5, 9], n=2,
    structured_outputs={"regex": "a+"}, prompt_logprobs=2, bad_words=["ab"], cache_salt="tenant-a",
    include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False,
)


def char_codes(text: str) -> list[int]:
    """A character-level tokenizer (ids below the test's vocabulary of 100): what bad_words are encoded with."""
    return [ord(c) - 30 for c in text]


def test_every_http_field_lands_in_sampling_params() -> None:
    body = ChatCompletionRequest.model_validate(BODY)
    first, second = sampling_params(body, max_tokens=20, logprobs=3, vocab=100, echo=True, encode=char_codes)
    expected = SamplingParams(
        max_tokens=20, min_tokens=2, temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=11,
        repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5, stop_token_ids=[4], ignore_eos=True,
        logprobs=3, logit_bias={5: 3.0, 9: -100.0}, allowed_token_ids=[4, 5, 9],
        structured=StructuredOutput(kind="regex", spec="a+"), prompt_logprobs=3,
        # "ab" as written and with a leading space (" " is 2 here).
        bad_words_ids=[[67, 68], [2, 67, 68]], cache_salt="tenant-a", include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False,
    )
    assert first == expected
    assert second == expected.model_copy(update={"seed": 12})  # choice i is seeded seed + i
    # Every field of the one type is set away from its default by this body: none is left unmapped
    # (reasoning_end_ids is no HTTP field: prepare_chat sets it from the template's reasoning plan; lora_name
    # neither: the gateway sets it when the request's model names a LoRA adapter).
    default = SamplingParams()
    unset = [f for f in SamplingParams.model_fields if getattr(first, f) == getattr(default, f)]
    assert unset == ["reasoning_end_ids", "lora_name"]


def test_logit_bias_keys_are_ints_from_the_gateway_to_the_engine() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"5": 1.5}})
    (params,) = sampling_params(body, max_tokens=4, logprobs=None, vocab=100)
    assert params.logit_bias == {5: 1.5} and type(next(iter(params.logit_bias))) is int
    req = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=params)
    back = wire.decode(wire.encode(req), GenerateRequest).sampling
    assert back.logit_bias == {5: 1.5} and type(next(iter(back.logit_bias))) is int


@pytest.mark.parametrize("field, value, param", [
    ("logit_bias", {"x": 1.0}, "logit_bias"),
    ("logit_bias", {"100": 1.0}, "logit_bias"),
    ("stop_token_ids", [100], "stop_token_ids"),
    ("allowed_token_ids", [], "allowed_token_ids"),
])  # fmt: skip
def test_bad_token_ids_are_a_400_naming_the_field(field: str, value: object, param: str) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(APIError) as e:
        sampling_params(body, max_tokens=4, logprobs=None, vocab=100)
    assert e.value.status == 400 and e.value.param == param


def test_a_tool_constraint_wins_and_response_format_maps() -> None:
    body = ChatCompletionRequest.model_validate({**BODY, "structured_outputs": None, "prompt_logprobs": None,
                                                 "response_format": {"type": "json_object"}})
    (params, _) = sampling_params(body, max_tokens=4, logprobs=None, vocab=100, encode=char_codes)
    assert params.structured == StructuredOutput(kind="json_object") and params.prompt_logprobs is None
    tool = StructuredOutput(kind="json_schema", spec="{}")
    (params, _) = sampling_params(body, max_tokens=4, logprobs=None, vocab=100, structured=tool, encode=char_codes)
    assert params.structured == tool
