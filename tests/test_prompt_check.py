"""The one set of prompt rules (shared/prompt_check.py) that the gateway, the tokenizer and the engine share."""
from __future__ import annotations

import pytest

from shared.prompt_check import PromptError, check_prompt, check_token_ids


@pytest.mark.parametrize("ids, limit, code, text", [
    ([], None, "empty_prompt", "at least one token"),
    ([1, 2, 100], None, "invalid_token_id", "token id 100 is outside the vocabulary [0, 100)"),
    ([-1, 2], None, "invalid_token_id", "token id -1 is outside"),
    ([1, 2, 3, 4], 4, "context_length_exceeded", "prompt has 4 tokens; the model's context is 4 tokens"),
])
def test_bad_prompts_name_their_problem(ids, limit, code, text) -> None:  # noqa: ANN001
    with pytest.raises(PromptError) as e:
        check_prompt(ids, 100, limit)
    assert e.value.code == code and text in e.value.message and e.value.param == "prompt"
    assert isinstance(e.value, ValueError)  # the engine's callers turn ValueErrors into bad-request replies


def test_good_prompts_and_named_ids_pass() -> None:
    check_prompt([0, 99], 100, 3)
    check_token_ids([], 100)
    check_token_ids(iter([5, 6]), 100)
    with pytest.raises(PromptError) as e:
        check_token_ids([7, 10**9], 100, "stop_token_ids", "stop_token_ids")
    assert e.value.param == "stop_token_ids" and e.value.message.startswith("stop_token_ids: token id 1000000000")
