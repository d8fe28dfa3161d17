"""Offline batch generation (vLLM's LLM.generate): queue every prompt, step until all finish."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from shared.engine.outputs import RequestOutput
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine calls this module; only its type is named here
    from shared.engine.llm_engine import LLMEngine


def generate(engine: LLMEngine, prompt_token_ids: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
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
