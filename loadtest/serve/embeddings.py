"""`kvmesh bench serve --endpoint embeddings`: embedding throughput of a server against the same model in process.

At each concurrency level (default 1, 8, 32) the server gets --num-prompts `/v1/embeddings` requests of one
text each, at most `level` in flight; requests/s and prompt tokens/s are over the level's wall time. The same
texts then go through sentence-transformers' `encode` (when installed: the model as Transformer + last-token or
mean Pooling + Normalize) and transformers' AutoModel in this process, `level` texts a batch (left padding,
attention mask), so each level compares the server with the libraries at the same parallelism; ratio = the
server's tokens/s over the library's. The first vector of each is checked against the server's (cosine).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

WORDS = ("the of and to in is was for on that with as by it at from this be are or his her their which capital "
         "city river sea mountain music weather rain sun snow cold hot apple banana red blue green embedding vector "
         "search query document model server request token batch memory cache network").split()


def texts_of(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def _server_level(url: str, model: str, texts: list[str], concurrency: int, timeout: float,
                        api_key: str | None) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    tokens = errors = 0
    first: list[float] | None = None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        async def one(i: int, text: str) -> None:
            nonlocal tokens, errors, first
            async with sem:
                r = await client.post(url, json={"model": model, "input": text})
            if r.status_code != 200:
                errors += 1
                return
            body = r.json()
            tokens += body["usage"]["prompt_tokens"]
            if i == 0:
                first = body["data"][0]["embedding"]

        await one(-1, texts[0])  # warm-up, not timed
        tokens = errors = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
        dt = time.perf_counter() - t0
    done = len(texts) - errors
    return {"requests": done, "errors": errors, "tokens": tokens, "seconds": dt,
            "requests_per_s": done / dt, "tokens_per_s": tokens / dt, "_first": first}


def _pooling_mode(model_dir: Path) -> str:
    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [""])[0]
    return "mean" if arch.startswith(("Bert", "Roberta", "XLMRoberta")) else "lasttoken"


def _sentence_transformers(model_dir: Path, texts: list[str], batch: int) -> dict[str, Any] | None:
    try:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers import models as st_models
    except ImportError:
        return None
    body = st_models.Transformer(str(model_dir))
    # sentence-transformers renders text through a chat model's chat template (its "message" modality); the
    # server embeds the text as it is, so the reference must too.
    getattr(body, "modality_config", {}).pop("message", None)
    body.tokenizer.padding_side = "left"  # last-token pooling reads the last position
    if body.tokenizer.pad_token is None:
        body.tokenizer.pad_token = body.tokenizer.eos_token
    dim = getattr(body, "get_embedding_dimension", None) or body.get_word_embedding_dimension  # renamed in 5.x
    pooling = st_models.Pooling(dim(), pooling_mode=_pooling_mode(model_dir))
    st = SentenceTransformer(modules=[body, pooling, st_models.Normalize()], device="cpu")
    st.encode(texts[:batch], batch_size=batch)  # warm-up
    t0 = time.perf_counter()
    vecs = st.encode(texts, batch_size=batch, convert_to_numpy=True)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "_first": vecs[0].tolist()}


def _transformers(model_dir: Path, texts: list[str], batch: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    mean = _pooling_mode(model_dir) == "mean"

    def run(chunk: list[str]) -> torch.Tensor:
        enc = tok(chunk, return_tensors="pt", padding=True)
        with torch.no_grad():
            h = model(**enc).last_hidden_state
        if mean:
            m = enc["attention_mask"][..., None].to(h.dtype)
            pooled = (h * m).sum(1) / m.sum(1)
        else:
            pooled = h[:, -1]
        return torch.nn.functional.normalize(pooled, dim=-1)

    run(texts[:batch])  # warm-up
    t0 = time.perf_counter()
    out = [run(texts[i:i + batch]) for i in range(0, len(texts), batch)]
    dt = time.perf_counter() - t0
    return {"seconds": dt, "_first": out[0][0].tolist()}


def _cos(a: list[float] | None, b: list[float] | None) -> float | None:
    if a is None or b is None:
        return None
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / np.linalg.norm(x) / np.linalg.norm(y))


def run(args: argparse.Namespace) -> int:
    if not args.reference_model:
        print("kvmesh bench serve --endpoint embeddings: --reference-model DIR (the served checkpoint) is needed "
              "for the in-process comparison", flush=True)
        return 2
    model_dir = Path(args.reference_model)
    levels = [int(x) for x in (args.sweep_concurrency or "1,8,32").split(",") if x.strip()]
    words = int(str(args.input_len).split(":")[0])
    texts = texts_of(args.num_prompts, max(1, words), args.seed)
    from tokenizers import Tokenizer

    counter = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokens = sum(len(e.ids) for e in counter.encode_batch(texts))
    url = args.base_url.rstrip("/").removesuffix("/v1") + "/v1/embeddings"
    report: dict[str, Any] = {"benchmark": "embeddings", "target": url, "model": args.model,
                              "reference_model": str(model_dir), "num_prompts": len(texts), "words_per_text": words,
                              "prompt_tokens": tokens, "levels": []}
    for level in levels:
        server = asyncio.run(_server_level(url, args.model, texts, level, args.request_timeout, args.api_key))
        row: dict[str, Any] = {"concurrency": level, "server": server}
        for name, fn in (("sentence_transformers", _sentence_transformers), ("transformers", _transformers)):
            ref = fn(model_dir, texts, level)
            if ref is None:
                row[name] = None
                continue
            ref.update(requests_per_s=len(texts) / ref["seconds"], tokens_per_s=tokens / ref["seconds"],
                       cosine_to_server=_cos(ref.pop("_first"), server["_first"]))
            row[name] = ref
            row[f"ratio_vs_{name}"] = server["tokens_per_s"] / ref["tokens_per_s"]
        server.pop("_first")
        report["levels"].append(row)
        if args.json:  # after every level: a run cut short keeps what it measured
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        st = row.get("sentence_transformers")
        print(f"concurrency {level:>3}: server {server['requests_per_s']:7.1f} req/s {server['tokens_per_s']:8.0f} tok/s"
              f" | transformers {row['transformers']['tokens_per_s']:8.0f} tok/s (x{row['ratio_vs_transformers']:.2f})"
              + (f" | sentence-transformers {st['tokens_per_s']:8.0f} tok/s (x{row['ratio_vs_sentence_transformers']:.2f})"
                 if st else " | sentence-transformers not installed"), flush=True)
    if args.json:
        print(f"json: {args.json}")
    return 0 if all(r["server"]["requests"] for r in report["levels"]) else 1
