"""Two real tokenizer families for detokenizer tests, built locally: byte-level BPE (GPT-2/Llama 3/Qwen style)
and SentencePiece-style BPE with byte fallback and a metaspace (Llama 2/Mistral style)."""
from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from shared.models.demo_tokenizer import cached_byte_bpe, train_sentencepiece_bpe, write_tokenizer_files
from shared.models.tokenizer import load_tokenizer


def byte_level_bpe(directory: Path):  # noqa: ANN201
    write_tokenizer_files(cached_byte_bpe(512), directory)
    return load_tokenizer(directory)


def sentencepiece_bpe():  # noqa: ANN201
    return PreTrainedTokenizerFast(tokenizer_object=train_sentencepiece_bpe(), bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
