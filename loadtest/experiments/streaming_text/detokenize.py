"""Per-token cost of the two incremental detokenizers on the same tokens, in one run:
`python -m loadtest.experiments.streaming_text.detokenize [--tokens N] [--json PATH]`.

Byte-level BPE (the demo tokenizer) and a SentencePiece-style tokenizer with byte fallback, each decoding
N generated tokens one at a time after a prompt, as the gateway does for a stream.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from shared.detokenizer import StreamDetokenizer, WindowDetokenizer
from shared.models.demo_tokenizer import cached_byte_bpe, train_sentencepiece_bpe, write_tokenizer_files
from shared.models.tokenizer import load_tokenizer

TEXT = "Grüße aus 東京 — naïve café 🎉 ok. The quick brown fox jumps over the lazy dog; 12345 == 0x3039! "


def per_token_us(make, ids: list[int], repeats: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(repeats):
        detok = make()
        t0 = time.perf_counter()
        for i in ids:
            detok.push([i])
        detok.flush()
        best = min(best, time.perf_counter() - t0)
    return best / len(ids) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        write_tokenizer_files(cached_byte_bpe(512), Path(d))
        sentencepiece = PreTrainedTokenizerFast(tokenizer_object=train_sentencepiece_bpe(), bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>", model_max_length=1 << 30)
        for name, tok in (("byte-level-bpe", load_tokenizer(Path(d))), ("sentencepiece", sentencepiece)):
            ids = (tok.encode(TEXT * (args.tokens // 20 + 1), add_special_tokens=False))[: args.tokens]
            prompt = tok.encode("Hello there", add_special_tokens=False)
            stream = per_token_us(lambda: StreamDetokenizer(tok, tok.backend_tokenizer, prompt), ids, args.repeats)
            window = per_token_us(lambda: WindowDetokenizer(tok, prompt), ids, args.repeats)
            results[name] = {"tokens": len(ids), "decode_stream_us_per_token": round(stream, 3),
                             "window_us_per_token": round(window, 3), "speedup": round(window / stream, 2)}
            print(f"{name:15s} DecodeStream {stream:7.2f} us/token   hand-written window {window:7.2f} us/token"
                  f"   {window / stream:5.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
