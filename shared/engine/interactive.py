"""`kvmesh generate`: chat with a model through the engine in this process (no mesh needed)."""
from __future__ import annotations

import argparse
import sys

from shared.config import EngineConfig
from shared.engine.errors import ConfigError
from shared.spec_config import SpeculativeConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.models.tokenizer import encode_chat, load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory, or a .gguf file")
    parser.add_argument("--prompt", help="one prompt, then exit (default: read prompts from stdin)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4} '
                             'or {"method": "suffix"} or {"method": "draft_model", "model": DIR}')
    parser.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model across this many ranks (processes; gloo on CPU, NCCL on CUDA)")


def run(args: argparse.Namespace) -> int:
    try:
        spec = SpeculativeConfig.parse(args.speculative_config)
    except ConfigError as e:
        print(f"kvmesh generate: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                                    speculative_config=spec))
    try:
        return _chat(engine, args)
    finally:
        engine.shutdown()


def _chat(engine: LLMEngine, args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    history: list[dict[str, str]] = []
    prompts = [args.prompt] if args.prompt is not None else _stdin_lines()
    for text in prompts:
        if args.raw:
            ids = tokenizer.encode(text)
        else:
            history.append({"role": "user", "content": text})
            ids = encode_chat(tokenizer, history)
        out = engine.generate([ids], params, use_tqdm=False)[0]
        reply = tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        if not args.raw:
            history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0


def _stdin_lines():
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")
