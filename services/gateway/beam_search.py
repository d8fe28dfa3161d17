"""vLLM's beam search (`use_beam_search`, beam width n or best_of, `length_penalty`), as vLLM serves it: the
search runs here, one token a step, and every step asks the engine for each live beam's next-token
distribution (the top 2 x width logprobs of one generated token). Beams of one prompt share their prefix:
each step's prompt is the previous step's plus one token, so the workers' prefix caches (block hashes
over full blocks) serve every full block a beam shares with its parent.

Scores as vLLM's: cumulative logprob / (tokens ** length_penalty), prompt tokens counted, a final stop
token not. A beam that draws a stop token (eos unless ignore_eos, or a stop_token_id) is complete; the
answer is the `width` best of the complete and the still-live beams, in score order, each distinct.
Streaming sends those beams once the search is over (as vLLM does).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from services.gateway.choice import Delta
from services.gateway.context import GatewayContext
from services.gateway.generation import Generation
from services.gateway.prepare import Prepared
from services.gateway.special_tokens import output_detokenizer
from shared.protocol.generate import TokenLogprob


@dataclass
class Beam:
    tokens: list[int]  # output tokens (a final stop token included)
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def score(self, prompt_len: int, stops: frozenset[int], length_penalty: float) -> float:
        n = prompt_len + len(self.tokens)
        if self.tokens and self.tokens[-1] in stops:
            n -= 1
        return self.cum_logprob / (n ** length_penalty)


class BeamGeneration:
    """Generation's interface (open, deltas, usage, abort/close/finish) over a beam search per prompt."""

    def __init__(self, ctx: GatewayContext, prepared: Prepared, span: trace.Span, arrival: float) -> None:
        assert prepared.beam is not None
        self.ctx, self.prepared, self.span, self.arrival = ctx, prepared, span, arrival
        self.width = prepared.beam.width
        self.results: list[list[Beam]] = []
        self._step: Generation | None = None
        self._cached: dict[int, int] = {}
        params = prepared.samplings[0]
        eos = () if params.ignore_eos else tuple(t for t in [ctx.tokenizer.eos_token_id] if t is not None)
        self.stops = frozenset([*eos, *params.stop_token_ids])

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prepared.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(b.tokens) for beams in self.results for b in beams)

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    async def open(self) -> None:
        """Runs the whole search (a refusal or an error is the request's HTTP status, as with Generation)."""
        with self.ctx.tracer.start_as_current_span("beam_search", context=trace.set_span_in_context(self.span),
                                                   attributes={"kvmesh.beam.width": self.width}):
            for k, prompt in enumerate(self.prepared.prompts):
                self.results.append(await self._search(k, prompt))

    async def _search(self, k: int, prompt: list[int]) -> list[Beam]:
        p, w = self.prepared, self.width
        params = p.samplings[0]
        shown = params.logprobs or 0
        # The engine's logprobs are of the raw distribution: the candidates whatever the sampling settings.
        step = params.model_copy(update={"max_tokens": 1, "min_tokens": 0, "logprobs": max(2 * w, shown),
                                         "prompt_logprobs": None, "ignore_eos": True, "seed": None, "temperature": 0.0})
        lp = p.beam.length_penalty
        live, done = [Beam([])], []
        key = lambda b: b.score(len(prompt), self.stops, lp)  # noqa: E731
        for t in range(p.max_tokens):
            dists = await self._next(k, t, [prompt + b.tokens for b in live], step)
            grown = []
            for beam, dist in zip(live, dists):
                for tid, logprob in zip(dist.top_ids, dist.top_logprobs):
                    chosen = TokenLogprob(token_id=tid, logprob=logprob, top_ids=dist.top_ids[:shown],
                                          top_logprobs=dist.top_logprobs[:shown])
                    nxt = Beam(beam.tokens + [tid], beam.cum_logprob + logprob, beam.logprobs + [chosen])
                    if tid in self.stops and len(nxt.tokens) > params.min_tokens:
                        nxt.finish_reason = "stop"
                        done.append(nxt)
                    elif tid not in self.stops:
                        grown.append(nxt)
            live = sorted(grown, key=key, reverse=True)[:w]
            if not live:
                break
        for b in live:
            b.finish_reason = "length"
        return sorted(done + live, key=key, reverse=True)[:len(p.samplings)]  # the n best of the width

    async def _next(self, k: int, t: int, prompts: list[list[int]], step) -> list[TokenLogprob]:  # noqa: ANN001
        """One engine step for every live beam: each one's next-token logprobs (top 2 x width)."""
        p = self.prepared
        req = dataclasses.replace(p, request_id=f"{p.request_id}-p{k}-t{t}", prompts=prompts, samplings=[step],
                                  stops=[], stop_regex=[], echo=None, tools=None, reasoning=None, stream=False,
                                  beam=None)
        gen = self._step = Generation(self.ctx, req, self.span, self.arrival)
        out: dict[int, TokenLogprob] = {}
        try:
            await gen.open()
            async for d in gen.deltas():
                if d.logprobs:
                    out[d.index] = d.logprobs[0]
        except BaseException:
            gen.abort("beam search stopped")
            raise
        finally:
            await gen.close()
        if t == 0:
            self._cached[k] = gen.cached_tokens
        return [out[i] for i in range(len(prompts))]

    async def deltas(self, idle_marks: bool = False) -> AsyncIterator[Delta]:
        """The finished beams as deltas. idle_marks (Generation.deltas'): none to give, as the search ran to the
        end in open() and no delta here waits for anything."""
        params = self.prepared.samplings[0]
        for k, beams in enumerate(self.results):
            for j, b in enumerate(beams):
                text_ids = b.tokens
                stopped = b.finish_reason == "stop"
                if stopped and not params.include_stop_str_in_output:
                    text_ids = text_ids[:-1]
                detok = output_detokenizer(self.ctx.tokenizer, self.prepared.prompts[k], params, self.ctx.added_tokens)
                text = detok.push(text_ids) + detok.flush()
                last = b.tokens[-1] if stopped else None
                yield Delta(index=k * len(self.prepared.samplings) + j, text=text, token_ids=list(b.tokens),
                            logprobs=b.logprobs if params.logprobs is not None else [], finish_reason=b.finish_reason,
                            stop_reason=last if last in params.stop_token_ids else None, matched_stop=last)

    def abort(self, reason: str) -> None:
        if self._step is not None:
            self._step.abort(reason)

    async def close(self) -> None:
        if self._step is not None:
            await self._step.close()

    def finish(self) -> None:
        self.span.set_attribute("gen_ai.usage.input_tokens", self.prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if self.results:
            self.ctx.metrics.e2e.labels(self.ctx.metrics.model).observe(time.monotonic() - self.arrival)
