"""The engine of a pooling worker: continuous batching by tokens, one forward pass a request, no KV.

Requests wait in arrival order; each step takes as many as fit in `max_num_batched_tokens` (and
`max_num_seqs`), always at least one, runs them as one packed batch and answers each. Requests that
arrive during a step join the next one. A prompt longer than the token budget runs alone: nothing is
kept between steps, so a pooling prompt is never chunked (its KV would have to be kept for the next
chunk). No prefix cache either: a hit would need the cached prefix's KV, which a pooling worker never keeps.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shared.engine.pooler import classify_head, embed_head, pool
from shared.models.pooling_config import PoolingSpec

log = logging.getLogger(__name__)


class PoolingModel(Protocol):
    device: torch.device
    hidden_size: int
    max_positions: int

    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor: ...

    def score(self, pooled: torch.Tensor) -> torch.Tensor: ...


@dataclass
class PoolJob:
    request_id: str
    token_ids: list[int]
    task: str  # "embed" | "classify" | "token"
    normalize: bool | None = None
    activation: bool | None = None
    dimensions: int | None = None
    # Called on the engine thread with (values [rows, cols] float32 on the CPU, or None, error text or None).
    done: Callable[[torch.Tensor | None, str | None], None] = lambda values, error: None
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class PoolingStats:
    steps: int = 0
    requests: int = 0
    tokens: int = 0
    running: int = 0
    iteration_tokens: list[int] = field(default_factory=list)  # the last steps' token counts (bounded)


class PoolingEngine:
    def __init__(self, model: PoolingModel, spec: PoolingSpec, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128) -> None:
        self.model, self.spec = model, spec
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.waiting: collections.deque[PoolJob] = collections.deque()
        self.stats = PoolingStats()

    def check(self, job: PoolJob) -> str | None:
        """Why the job cannot run, or None."""
        if not job.token_ids:
            return "empty input"
        if len(job.token_ids) > self.model.max_positions:
            return f"{len(job.token_ids)} tokens is more than the model's {self.model.max_positions}-token context"
        if job.task == "classify" and self.spec.task != "classify":
            return "the served model has no classification head"
        if job.task not in ("embed", "classify", "token"):
            return f"unknown pooling task {job.task!r}"
        if job.dimensions is not None and not 0 < job.dimensions <= self.model.hidden_size:
            return f"dimensions must be in [1, {self.model.hidden_size}]"
        return None

    def schedule(self) -> list[PoolJob]:
        batch: list[PoolJob] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting[0].token_ids)
            if batch and tokens + n > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def step(self) -> int:
        """Schedules and runs one batch; returns how many requests it answered."""
        return self.run(self.schedule())

    def run(self, batch: list[PoolJob]) -> int:
        if not batch:
            return 0
        seq_lens = [len(j.token_ids) for j in batch]
        self.stats.running = len(batch)
        try:
            ids = torch.tensor([t for j in batch for t in j.token_ids], dtype=torch.long, device=self.model.device)
            hidden = self.model.forward(ids, seq_lens)
            results = self._heads(batch, hidden, seq_lens)
        except Exception as e:  # noqa: BLE001 - a failed batch answers its requests, the worker goes on
            log.exception("pooling step failed")
            for j in batch:
                j.done(None, f"pooling failed: {e}")
            return len(batch)
        finally:
            self.stats.running = 0
        self.stats.steps += 1
        self.stats.requests += len(batch)
        self.stats.tokens += sum(seq_lens)
        self.stats.iteration_tokens = (self.stats.iteration_tokens + [sum(seq_lens)])[-256:]
        for j, values in zip(batch, results):
            j.done(values, None)
        return len(batch)

    @torch.inference_mode()
    def _heads(self, batch: list[PoolJob], hidden: torch.Tensor, seq_lens: list[int]) -> list[torch.Tensor]:
        pooler = self.spec.pooler
        pooled = pool(hidden, seq_lens, pooler.pooling_type or "LAST")
        out: list[torch.Tensor] = []
        logits = self.model.score(pooled) if any(j.task == "classify" for j in batch) else None
        start = 0
        for i, j in enumerate(batch):
            if j.task == "token":
                out.append(hidden[start:start + seq_lens[i]].float().cpu())
            elif j.task == "classify":
                act = pooler.activation if j.activation is None else j.activation
                out.append(classify_head(logits[i:i + 1], bool(act)).cpu())
            else:
                norm = pooler.normalize if j.normalize is None else j.normalize
                out.append(embed_head(pooled[i:i + 1], bool(norm), j.dimensions).cpu())
            start += seq_lens[i]
        return out


class PoolingThread:
    """The engine on its own thread: submit() from any thread, each job's done() is called on this one."""

    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pooling-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: PoolJob) -> None:
        with self._cv:
            self.engine.waiting.append(job)
            self._cv.notify()

    def cancel(self, request_id: str) -> bool:
        """Drops a job still waiting (a running one finishes: its step is one forward pass)."""
        with self._cv:
            for j in list(self.engine.waiting):
                if j.request_id == request_id:
                    self.engine.waiting.remove(j)
                    return True
        return False

    def waiting(self) -> int:
        return len(self.engine.waiting)

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self.engine.waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    for j in self.engine.waiting:
                        j.done(None, "the worker is shutting down")
                    self.engine.waiting.clear()
                    return
                batch = self.engine.schedule()
            self.engine.run(batch)
