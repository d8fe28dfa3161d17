"""A small byte-level BPE tokenizer trained offline, and the files that make it a HF tokenizer.

Shaped like Llama 3 / Qwen2: byte-level BPE with no prefix space (so decode(encode(s)) == s for any
UTF-8 text), special tokens placed after the learned vocabulary, BOS added by the post-processor,
and a ChatML chat template that starts with the BOS token (chat templates are tokenized without
special tokens, so the template must write BOS itself).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from shared.models.demo_corpus import TEXT

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)
MODEL_MAX_LENGTH = 2048

# ChatML, with tools the way Qwen2.5/Qwen3 (Hermes-style) render them: the function signatures in a
# system block inside <tools></tools>, the assistant's calls as <tool_call>{json}</tool_call>, tool
# results as <tool_response> in a user turn. `bos_token` comes from the tokenizer's special tokens map.
DEFAULT_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + '\\\", \\\"arguments\\\": ' "
    "+ call['function']['arguments'] + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def train_byte_bpe(vocab_size: int = 2048) -> Tokenizer:
    """Train on the shipped corpus; `vocab_size` counts the special tokens. Deterministic.

    A corpus too small for `vocab_size` merges gives a smaller vocabulary, never an error:
    read `get_vocab_size()` rather than assuming.
    """
    assert vocab_size > 256 + len(SPECIAL_TOKENS), "vocab_size must exceed the 256 byte tokens + specials"
    tok = Tokenizer(models.BPE())
    # No prefix space: a leading space would be invented on encode and kept on decode.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, seen or not
    )
    tok.train_from_iterator(_paragraphs(TEXT), trainer=trainer)
    # Added after training so they get the highest ids, as in Llama 3 and Qwen2.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


@functools.lru_cache(maxsize=8)
def cached_byte_bpe(vocab_size: int = 512) -> Tokenizer:
    """`train_byte_bpe` once per process per size, for tests that build many tiny checkpoints.

    Callers share the returned object: do not mutate it (write_tokenizer_files does not).
    """
    return train_byte_bpe(vocab_size)


@functools.lru_cache(maxsize=2)
def train_sentencepiece_bpe(vocab_size: int = 400) -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama 2 / Mistral family): metaspace normaliser, BPE with byte
    fallback, and the 256 byte tokens as ordinary (not special) vocabulary entries, so skip_special_tokens
    keeps them. For tests and benchmarks of the detokenizer on the second tokenizer family."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(_paragraphs(TEXT), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return Tokenizer.from_str(json.dumps(spec))


def write_tokenizer_files(
    tok: Tokenizer,
    out_dir: str | Path,
    *,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    template_in_jinja_file: bool = False,
) -> None:
    """Write tokenizer.json + tokenizer_config.json (+ chat_template.jinja) into `out_dir`.

    Real checkpoints carry the chat template either inline in tokenizer_config.json (older) or in
    chat_template.jinja (transformers >= 4.50); `template_in_jinja_file` picks which to imitate.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MODEL_MAX_LENGTH,
        # The default would turn " ." into "." on decode and break byte-exact round trips.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()  # a stale file would win over the inline template on load
    if chat_template is not None and template_in_jinja_file:
        jinja.write_text(chat_template, encoding="utf-8")
    elif chat_template is not None:
        config["chat_template"] = chat_template
    text = json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def _paragraphs(text: str) -> list[str]:
    # Fixed-order chunks: training sees the same sequences every run.
    return [p for p in text.split("\n\n") if p.strip()]
