"""Offline batch generation (vLLM's LLM.generate): queue every prompt, step until all finish."""
from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Protocol

from tqdm import tqdm

from shared.engine.outputs import RequestOutput
from shared.sampling_params import SamplingParams


class Steppable(Protocol):
    """What offline generation needs of an engine (LLMEngine, SimEngine): the engine imports this module, so
    it is named by what it does rather than imported."""

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


def generate(engine: Steppable, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
             use_tqdm: bool = True) -> list[RequestOutput]:
    """Each prompt's finished RequestOutput, in prompt order."""
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_token_ids)
    assert len(params) == len(prompt_token_ids), "one SamplingParams per prompt"
    ids = [f"offline-{time.monotonic_ns()}-{i}" for i in range(len(prompt_token_ids))]
    for rid, prompt, p in zip(ids, prompt_token_ids, params):
        engine.add_request(rid, prompt, p)
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
    return [done[rid] for rid in ids]
