"""Which CUDA graphs an engine captures at start, all in one memory pool: decode steps per batch bucket, then
(speculative decoding) verify steps per (requests, draft length) bucket and the draft model's one-token steps."""
from __future__ import annotations

from shared.config import EngineConfig
from shared.engine.model_runner import ModelRunner
from shared.engine.spec.draft_model import DraftModel
from shared.engine.verify_buckets import verify_plan_for


def capture_graphs(runner: ModelRunner, c: EngineConfig, max_model_len: int, draft: DraftModel | None,
                   one_rank: bool) -> None:
    graphs = runner.use_decode_graphs(max_model_len, c.max_num_seqs)
    pool = graphs.pool
    verify = verify_plan_for(c, max_model_len)
    if verify is not None and one_rank:  # tensor parallel: verify steps stay eager (docs/architecture.md)
        pool = runner.use_verify_graphs(verify).pool
    if draft is not None:
        draft.use_decode_graphs(pool=pool)
