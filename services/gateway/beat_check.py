"""A load beat is believed only when it is consistent with its subject and with the model: a worker
speaks only for itself, and nothing it claims may make valid requests fail (a forged max_model_len of 1
once turned every request into a 400)."""
from __future__ import annotations

from shared import subjects
from shared.protocol.events import LoadBeat

MIN_MODEL_LEN = 2  # a prompt token and one generated token


def beat_problem(beat: LoadBeat, subject: str, model_max_len: int, role: str) -> str | None:
    """Why the beat must be ignored, or None."""
    try:
        if subjects.worker_from_subject(subject) != beat.worker_id:
            return f"worker {beat.worker_id!r} beat on another worker's subject {subject!r}"
    except ValueError:
        return f"bad subject {subject!r}"
    if beat.role != role:
        return f"a {beat.role} beat on the {role} subject"
    if min(beat.running, beat.waiting, beat.free_blocks, beat.total_blocks) < 0 or beat.free_blocks > beat.total_blocks:
        return "negative or inconsistent counts"
    if beat.block_size < 1 or beat.block_size & (beat.block_size - 1):
        return f"block size {beat.block_size} is not a power of two"
    if beat.max_model_len and not MIN_MODEL_LEN <= beat.max_model_len <= model_max_len:
        return f"max_model_len {beat.max_model_len} outside [{MIN_MODEL_LEN}, {model_max_len}] of the model"
    return None
