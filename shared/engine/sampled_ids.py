"""A step's sampled ids while they are still on the device, and the one copy that brings them to the host.

The ids (and the logprobs some rows asked for) are packed into one device tensor, so the host reads them in a
single transfer. `result()` reads them: a plain blocking copy, unless `copy_to_host()` already enqueued a
non-blocking copy into pinned memory, in which case it waits only for that copy's event. Async scheduling
(shared/engine/async_step.py) enqueues the copy at launch, feeds the device ids straight into the next step,
and reads the host copy while that next step computes.
"""
from __future__ import annotations

import torch

from shared.engine.outputs import TokenLogprobs
from shared.sampling_params import SamplingParams


class SampledIds:
    def __init__(self, tokens: torch.Tensor, raw: torch.Tensor | None, top_n: int | None,
                 params: list[SamplingParams]) -> None:
        """tokens: int64 [rows] on the device; raw: the rows' log-softmax when some row asked for logprobs."""
        self.tokens = tokens
        self._params = params
        self._top_n = top_n
        self._with_logprobs = raw is not None
        self._packed = tokens if raw is None else _pack(tokens, raw, top_n)
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def copy_to_host(self) -> SampledIds:
        """Enqueue the copy to the host without waiting for it (on CPU there is nothing to enqueue)."""
        if self._packed.is_cuda:
            self._host = torch.empty(self._packed.shape, dtype=self._packed.dtype, pin_memory=True)
            self._host.copy_(self._packed, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        return self

    def result(self) -> list[tuple[int, TokenLogprobs | None]]:
        """(token, logprobs or None) per row; waits for the device when the ids are not on the host yet."""
        if self._ready is not None:
            self._ready.synchronize()
            rows = self._host.tolist()
        else:
            rows = self._packed.tolist()
        if not self._with_logprobs:
            return [(t, None) for t in rows]
        return _unpack(rows, self._params, self._top_n)


def _pack(tokens: torch.Tensor, raw: torch.Tensor, top_n: int | None) -> torch.Tensor:
    """[rows, 2 (+ 2 top_n)] float32: token, its logprob, then the top values and ids. Ids are exact in float32
    (vocabularies are far below 2**24)."""
    cols = [tokens.float().unsqueeze(1), raw.gather(1, tokens.unsqueeze(1))]
    if top_n:
        vals, idx = torch.topk(raw, top_n, dim=-1)
        cols += [vals, idx.float()]
    return torch.cat(cols, 1)


def _unpack(packed: list[list[float]], params: list[SamplingParams], top_n: int | None
            ) -> list[tuple[int, TokenLogprobs | None]]:
    out: list[tuple[int, TokenLogprobs | None]] = []
    for row, p in zip(packed, params):
        tok = int(row[0])
        if p.logprobs is None:
            out.append((tok, None))
            continue
        n = p.logprobs
        top = [(int(i), v) for v, i in zip(row[2 : 2 + n], row[2 + top_n : 2 + top_n + n])] if n else []
        out.append((tok, TokenLogprobs(tok, row[1], top)))
    return out
