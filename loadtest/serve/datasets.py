"""Workloads: what the benchmark sends.

A workload is a list of jobs. A job is a list of turns sent one after another on one
conversation; single-shot datasets have one turn per job. Multi-turn needs this shape
because each turn resends the history *plus the answer the server actually gave*, which
only exists at run time.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence, Union

Prompt = Union[str, list[int]]


class TextTokenizer(Protocol):
    """The part of a `tokenizers.Tokenizer` we use to make text of an exact token length."""

    def encode(self, text: str, add_special_tokens: bool = True): ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Turn:
    prompt: Prompt  # text, or token ids (only /v1/completions servers that accept ids take these)
    output_len: int  # max_tokens to request
    prompt_len: int  # client-side estimate; the server's usage wins when it reports one


@dataclass(frozen=True)
class Job:
    index: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    jobs: tuple[Job, ...]
    meta: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(j.turns) for j in self.jobs)


def parse_len(spec: str, range_ratio: float) -> tuple[int, int]:
    """`N` with a range ratio -> [N(1-r), N(1+r)] as vLLM does; `LO:HI` -> exactly that range."""
    if ":" in spec:
        lo, hi = (int(x) for x in spec.split(":", 1))
    else:
        n = int(spec)
        assert 0.0 <= range_ratio < 1.0, "range ratio must be in [0, 1)"
        lo, hi = int(n * (1 - range_ratio)), int(n * (1 + range_ratio))
    lo = max(lo, 1)
    assert lo <= hi, f"bad length range {spec!r}"
    return lo, hi


# Pseudo-words from syllables: deterministic, no word list to ship, and ordinary BPE
# vocabularies split them into roughly one or two tokens each.
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "de", "po", "gu", "fe", "ba", "zo", "ti", "me")


def _random_words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))


@dataclass(frozen=True)
class PromptMaker:
    """Makes prompts of a target token length, as token ids or as text."""

    kind: str = "text"  # "text" or "ids"
    id_pool: tuple[int, ...] = ()  # token ids random prompts draw from (ids kind)
    tokenizer: TextTokenizer | None = None

    def make(self, rng: random.Random, n: int) -> Prompt:
        if self.kind == "ids":
            assert self.id_pool, "token-id prompts need --vocab-size or --tokenizer"
            return [rng.choice(self.id_pool) for _ in range(n)]
        if self.tokenizer is None:
            return _random_words(rng, n)
        # Trim a generous run of words to n tokens so prompt lengths mean tokens. Cutting inside
        # a word can make decode->encode merge across the cut, so take a few more until it fits.
        ids = self.tokenizer.encode(_random_words(rng, n * 2), add_special_tokens=False).ids
        take = n
        for _ in range(4):
            text = self.tokenizer.decode(ids[:take])
            got = len(self.tokenizer.encode(text, add_special_tokens=False).ids)
            if got == n:
                break
            take += n - got
        return text


def id_pool(vocab_size: int | None, tokenizer=None, skip_low: int = 4) -> tuple[int, ...]:
    """Ids safe to send as random prompts: a tokenizer's vocabulary minus its special/added
    tokens (an EOS in the prompt would change what is measured), else [skip_low, vocab_size)
    since small vocabularies usually keep their specials at the bottom."""
    if tokenizer is not None:
        special = set(tokenizer.get_added_tokens_decoder())
        return tuple(i for i in range(tokenizer.get_vocab_size()) if i not in special)
    return tuple(range(skip_low, vocab_size)) if vocab_size else ()


def random_dataset(
    maker: PromptMaker, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> Workload:
    rng = random.Random(seed)
    jobs = []
    for i in range(num_prompts):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        jobs.append(Job(i, (Turn(maker.make(rng, n_in), n_out, n_in),)))
    return Workload("random", tuple(jobs), {"input_len": input_len, "output_len": output_len})


def _concat(a: Prompt, b: Prompt) -> Prompt:
    if isinstance(a, list):
        assert isinstance(b, list)
        return a + b
    return f"{a} {b}"


def shared_prefix_dataset(
    maker: PromptMaker, num_prompts: int, groups: int, prefix_len: int, suffix_len: int,
    output_len: tuple[int, int], seed: int,
) -> Workload:
    """Prompt i = prefix of group i % groups + its own suffix. Round-robin over groups so
    consecutive requests hit different prefixes: what KV-aware routing has to sort out."""
    rng = random.Random(seed)
    prefixes = [maker.make(rng, prefix_len) for _ in range(groups)]
    jobs = []
    for i in range(num_prompts):
        prompt = _concat(prefixes[i % groups], maker.make(rng, suffix_len))
        jobs.append(Job(i, (Turn(prompt, rng.randint(*output_len), prefix_len + suffix_len),)))
    meta = {"groups": groups, "prefix_len": prefix_len, "suffix_len": suffix_len}
    return Workload("shared-prefix", tuple(jobs), meta)


def multi_turn_dataset(
    maker: PromptMaker, num_conversations: int, turns: int, input_len: tuple[int, int],
    output_len: tuple[int, int], seed: int,
) -> Workload:
    """Each turn's prompt is only the new user message; the runner prepends the history."""
    assert maker.kind == "text", "multi-turn resends the server's answers, so it needs text prompts"
    rng = random.Random(seed)
    jobs = []
    for c in range(num_conversations):
        ts = []
        for _ in range(turns):
            n_in = rng.randint(*input_len)
            ts.append(Turn(maker.make(rng, n_in), rng.randint(*output_len), n_in))
        jobs.append(Job(c, tuple(ts)))
    return Workload("multi-turn", tuple(jobs), {"turns": turns})


def jsonl_dataset(path: str | Path, num_prompts: int | None, default_output_len: int) -> Workload:
    """One JSON object a line: {"prompt": str | [ids]} and optional "output_len" (or "max_tokens").
    Lines are reused cyclically when more prompts are asked for than the file has."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    assert rows, f"{path}: no prompts"
    n = num_prompts or len(rows)
    jobs = []
    for i in range(n):
        row = rows[i % len(rows)]
        prompt = row["prompt"]
        out = int(row.get("output_len", row.get("max_tokens", default_output_len)))
        est = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        jobs.append(Job(i, (Turn(prompt, out, est),)))
    return Workload("jsonl", tuple(jobs), {"path": str(path)})


def take(workload: Workload, jobs: Sequence[Job]) -> Workload:
    return Workload(workload.name, tuple(jobs), workload.meta)
