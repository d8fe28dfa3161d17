"""The one mapping from an OpenAI/vLLM request body to the engine's SamplingParams.

Every HTTP sampling field is read here and nowhere else; the result crosses the wire and reaches the
engine as is (shared/sampling_params.py). Token ids are judged against the vocabulary here so a bad
one is the caller's 400 rather than a worker's error.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import re2
from pydantic import ValidationError

from services.gateway.errors import bad_request
from services.gateway.schemas import StructuredOutputsParams, _Common
from shared.prompt_check import PromptError, check_token_ids
from shared.sampling_params import SamplingParams, StructuredOutput


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "json_schema", "regex", "ebnf")
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_CHARS = 512  # a stop pattern is a short marker; RE2's program grows with the pattern
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is the caller's 400, not a line in the gateway's log
_RE2_OPTIONS.max_mem = 1 << 20  # RE2 refuses a pattern whose program would need more (e.g. a{1000}{1000})
StopRegex = Any  # re2's compiled pattern: search(text) and .pattern, as re.Pattern

Encode = Callable[[str], list[int]]  # text -> token ids, without special tokens (the served tokenizer)


def sampling_params(body: _Common, *, max_tokens: int, logprobs: int | None, vocab: int, echo: bool = False,
                    structured: StructuredOutput | None = None, encode: Encode | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice (body.n); choice i is seeded seed + i. `structured` (a tool
    constraint) wins over the body's own response_format / structured_outputs. `encode` tokenizes
    bad_words."""
    logit_bias = logit_bias_ids(body.logit_bias, vocab)
    bad_words = bad_words_ids(body.bad_words, encode, vocab)
    stop_regexes(body)  # judged here, applied where text is made (services/gateway/stop.py)
    # echo with logprobs reports the prompt's tokens too; prompt_logprobs asks for them outright. One count
    # serves both: the formatter shows each as many alternatives as it asked for.
    prompt_logprobs = body.prompt_logprobs
    if echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    for name in ("stop_token_ids", "allowed_token_ids"):
        try:
            check_token_ids(getattr(body, name) or [], vocab, name, name)
        except PromptError as e:
            raise bad_request(e.message, param=e.param, code=e.code) from None
    if body.allowed_token_ids is not None and not body.allowed_token_ids:
        raise bad_request("allowed_token_ids must not be empty", param="allowed_token_ids")
    try:
        structured = structured or structured_output(body)
    except (ValidationError, ValueError) as e:  # too large or too deep (shared/sampling_params.py)
        param = next((n for n in STRUCTURED_FIELDS if getattr(body, n, None) is not None), "response_format")
        raise bad_request(first_message(e), param=param, code="structured_output_too_large") from None
    out = []
    for i in range(body.n):
        try:
            out.append(SamplingParams(
                max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=body.temperature, top_k=body.top_k,
                top_p=body.top_p, min_p=body.min_p, seed=None if body.seed is None else body.seed + i,
                repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos, logprobs=logprobs,
                stop_token_ids=list(body.stop_token_ids or []), logit_bias=logit_bias,
                allowed_token_ids=body.allowed_token_ids, structured=structured, prompt_logprobs=prompt_logprobs,
                bad_words_ids=bad_words, cache_salt=body.cache_salt,
                include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
                skip_special_tokens=body.skip_special_tokens,
                spaces_between_special_tokens=body.spaces_between_special_tokens,
            ))
        except (ValidationError, ValueError) as e:
            raise bad_request(first_message(e)) from None
    return out


def bad_words_ids(words: list[str] | None, encode: Encode | None, vocab: int) -> list[list[int]] | None:
    """vLLM's bad_words: each word as written and with a leading space (how it reads mid-sentence), the
    distinct token sequences of both."""
    if not words:
        return None
    if encode is None:
        raise bad_request("bad_words needs the served tokenizer", param="bad_words")
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words: a word must not be empty or only spaces", param="bad_words")
        for variant in (word, " " + word.lstrip()):
            ids = [t for t in encode(variant) if 0 <= t < vocab]
            if ids and ids not in out:
                out.append(ids)
    return out


def stop_regexes(body: _Common) -> list[StopRegex]:
    """SGLang's stop_regex, compiled with RE2 (linear time in the text searched, whatever the pattern: a
    backtracking engine lets one short pattern freeze the gateway's event loop). A pattern longer than
    MAX_STOP_REGEX_CHARS, one RE2 refuses (backreferences, lookaround) or one matching the empty string is a 400."""
    raw = body.stop_regex
    patterns = [raw] if isinstance(raw, str) else list(raw or [])
    if len(patterns) > MAX_STOP_REGEXES:
        raise bad_request(f"at most {MAX_STOP_REGEXES} stop_regex patterns are supported", param="stop_regex")
    out = []
    for p in patterns:
        if len(p) > MAX_STOP_REGEX_CHARS:
            raise bad_request(f"stop_regex: a pattern of {len(p)} characters is too long (at most "
                              f"{MAX_STOP_REGEX_CHARS})", param="stop_regex", code="stop_regex_too_long")
        try:
            compiled = re2.compile(p, _RE2_OPTIONS)
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise bad_request(f"stop_regex {p!r} is not a regular expression RE2 accepts (no backreferences or "
                              f"lookaround; its memory is bounded): {why}", param="stop_regex") from None
        if compiled.fullmatch("") is not None:
            raise bad_request(f"stop_regex {p!r} matches the empty string (it would stop at once)", param="stop_regex")
        out.append(compiled)
    return out


def structured_output(body: _Common) -> StructuredOutput | None:
    """response_format / vLLM's structured_outputs -> the engine's constraint (compiled, and judged, there)."""
    rf, so = body.response_format, body.structured_outputs
    param = "structured_outputs"
    guided = {k: v for k, v in (("json", body.guided_json), ("regex", body.guided_regex),
                                ("choice", body.guided_choice), ("grammar", body.guided_grammar)) if v is not None}
    if guided:
        # vLLM's guided_* fields are structured_outputs under their older names.
        name = "guided_" + next(iter(guided))
        if len(guided) != 1 or so is not None:
            raise bad_request(f"{name}: give one of guided_json, guided_regex, guided_choice, guided_grammar, and "
                              "not with structured_outputs", param=name)
        so, param = StructuredOutputsParams.model_validate(guided), name
    spec = None
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            spec = StructuredOutput(kind="json_object")
        else:
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema", param="response_format")
            spec = StructuredOutput(kind="json_schema", spec=json.dumps(rf.json_schema.schema_))
    sglang = {k: v for k, v in (("regex", body.regex), ("ebnf", body.ebnf), ("json_schema", body.json_schema))
              if v is not None}
    if sglang:
        return _sglang_constraint(sglang, spec is not None or so is not None)
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                   ("grammar", so.grammar)) if v is not None}
        if len(given) != 1 or spec is not None:
            raise bad_request(f"{param} takes exactly one of json, regex, choice, grammar, and not "
                              "together with response_format", param=param)
        ((key, value),) = given.items()
        if key == "json":
            spec = StructuredOutput(kind="json_schema", spec=value if isinstance(value, str) else json.dumps(value))
        elif key == "choice":
            if not value:
                raise bad_request(f"{param}: the choice list must not be empty", param=param)
            spec = StructuredOutput(kind="choice", spec=json.dumps(value))
        else:
            try:
                spec = StructuredOutput(kind=key, spec=value)
            except (ValidationError, ValueError) as e:
                raise bad_request(first_message(e), param=param) from None
    return spec


def _sglang_constraint(given: dict[str, str], other: bool) -> StructuredOutput:
    """SGLang's top-level regex / ebnf / json_schema: exactly one, and not with the OpenAI/vLLM fields."""
    name = next(iter(given))
    if len(given) != 1 or other:
        raise bad_request(f"{name}: give one constraint, among regex, ebnf, json_schema, response_format and "
                          "structured_outputs", param=name)
    value = given[name]
    if name == "json_schema":
        try:
            json.loads(value)
        except ValueError as e:
            raise bad_request(f"json_schema is not JSON: {e}", param="json_schema") from None
    # ebnf is xgrammar's grammar text (GBNF-style EBNF), what structured_outputs.grammar takes.
    try:
        return StructuredOutput(kind={"regex": "regex", "ebnf": "grammar", "json_schema": "json_schema"}[name],
                                spec=value)
    except (ValidationError, ValueError) as e:
        raise bad_request(first_message(e), param=name) from None


def logit_bias_ids(raw: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: JSON object keys are token ids as strings (the only place they are strings);
    values in [-100, 100].

    Every bad key is named in one error (a client fixing them one 400 at a time would need as many calls)."""
    if not raw:
        return None
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} entries (got {len(raw)})", param="logit_bias",
                          code="invalid_value")
    out: dict[int, float] = {}
    not_ids, outside, out_of_range = [], [], []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            not_ids.append(key)
            continue
        if not 0 <= token < vocab:
            outside.append(token)
        elif not -100 <= value <= 100:
            out_of_range.append(f"{token} ({value:g})")
        else:
            out[token] = float(value)
    problems = []
    if not_ids:
        problems.append("keys that are not token ids: " + ", ".join(repr(k) for k in not_ids))
    if outside:
        problems.append(f"token ids outside the vocabulary [0, {vocab}): " + ", ".join(map(str, outside)))
    if out_of_range:
        problems.append("biases outside [-100, 100] for tokens " + ", ".join(out_of_range))
    if problems:
        code = "invalid_token_id" if outside and not not_ids and not out_of_range else "invalid_value"
        raise bad_request("logit_bias: " + "; ".join(problems), param="logit_bias", code=code)
    return out


def first_message(e: Exception) -> str:
    if isinstance(e, ValidationError) and e.errors():
        return str(e.errors()[0].get("msg", e)).removeprefix("Value error, ")
    return str(e)
