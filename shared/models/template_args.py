"""Which chat_template_kwargs reach a chat template.

transformers' apply_chat_template takes the template's extra variables as its own **kwargs, next to its own
arguments: a key named like one of those (padding, max_length, tokenizer_kwargs, chat_template, ...) would be
that argument, not a variable (padding to millions of ids, a template that skips the size cap). Such keys are
refused by name; of the rest, only the variables the template references are passed on (vLLM's rule: the
template's undeclared variables, found with jinja2.meta), so nothing else can reach the renderer at all.

Import-light (jinja2 only): the gateway judges a request's kwargs with it before anything is sent.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# apply_chat_template's own parameters and the tokenizer call's (transformers 4.4x-5.x), and the variables the
# renderer sets itself (the conversation, tools and documents travel in their own request fields).
TOKENIZER_ARGUMENTS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "text", "text_pair", "text_target", "text_pair_target",
    "add_special_tokens", "stride", "is_split_into_words", "pad_to_multiple_of", "padding_side",
    "return_token_type_ids", "return_attention_mask", "return_overflowing_tokens", "return_special_tokens_mask",
    "return_offsets_mapping", "return_length", "verbose", "split_special_tokens", "processor_kwargs",
})
# apply_chat_template arguments the gateway itself sets from the request's own fields (vLLM's chat extras).
GATEWAY_ARGUMENTS = frozenset({"continue_final_message", "documents"})


def refused_names(kwargs: Mapping[str, object]) -> list[str]:
    """The keys of chat_template_kwargs that are tokenizer arguments, not template variables."""
    return sorted(k for k in kwargs if k in TOKENIZER_ARGUMENTS or k in GATEWAY_ARGUMENTS)


@lru_cache(maxsize=16)
def referenced_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its context (jinja2.meta's undeclared variables)."""
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        # transformers' environment knows a {% generation %} tag plain jinja2 does not: without it, nothing is
        # known to be read, so nothing extra is passed (the render then reports the syntax error itself).
        try:
            ast = env.parse(template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
                            .replace("{%- generation %}", "").replace("{%- endgeneration %}", ""))
        except jinja2.TemplateSyntaxError:
            return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def template_variables(template: str | Mapping[str, str] | None, kwargs: Mapping[str, object]) -> dict[str, object]:
    """kwargs without tokenizer arguments (ValueError naming them) and without the variables the template (every
    one of a named set) never reads."""
    bad = refused_names(kwargs)
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}: these are tokenizer arguments, not "
                         "chat template variables")
    sources = list(template.values()) if isinstance(template, Mapping) else [template] if template else []
    used = frozenset().union(*(referenced_variables(t) for t in sources))
    return {k: v for k, v in kwargs.items() if k in used}
