"""Speculative decoding's acceptance, read from the server's Prometheus /metrics around a measured run.

Counters (cumulative on the server, so a run's figures are after - before), under either prefix:
kvmesh:spec_decode_* (the gateway, from its workers' load beats) or vllm:spec_decode_* (vLLM itself):
num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos{position}. Summed over
every other label (workers, engines).

Derived as vLLM defines them:
- mean acceptance length = 1 + accepted tokens / drafts (tokens each verify step yields, the bonus one included)
- draft acceptance rate = accepted tokens / draft tokens
- per-position acceptance rate = accepted at position i / drafts

A server without /metrics, or without these counters, gives None for all of them; never an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("kvmesh:", "vllm:")
_SCALARS = {"spec_decode_num_drafts": "num_drafts", "spec_decode_num_draft_tokens": "num_draft_tokens",
            "spec_decode_num_accepted_tokens": "num_accepted_tokens"}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SCRAPE_TIMEOUT_S = 2.0  # /metrics answers in milliseconds; a server slower than this is not worth waiting for


@dataclass(frozen=True)
class SpecCounters:
    """The server's cumulative spec_decode counters at one moment."""

    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)  # position -> drafts accepted up to and at it

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens,
                            {p: v - before.per_pos.get(p, 0.0) for p, v in self.per_pos.items()})


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The spec_decode counters in a Prometheus text exposition; None when it has none of them.
    One prefix only: kvmesh's if present, else vLLM's (a server exports one set; never count both)."""
    found: dict[str, dict[str, float]] = {p: {} for p in PREFIXES}
    per_pos: dict[str, dict[int, float]] = {p: {} for p in PREFIXES}
    for fam in text_string_to_metric_families(text):
        prefix = next((p for p in PREFIXES if fam.name.startswith(p)), None)
        if prefix is None:
            continue
        name = fam.name[len(prefix):]
        # Counters: the value is the _total sample (the parser also yields _created timestamps).
        totals = [s for s in fam.samples if s.name.endswith("_total")]
        if name in _SCALARS:
            found[prefix][_SCALARS[name]] = found[prefix].get(_SCALARS[name], 0.0) + sum(s.value for s in totals)
        elif name == _PER_POS:
            into = per_pos[prefix]
            for s in totals:
                pos = int(s.labels["position"])
                into[pos] = into.get(pos, 0.0) + s.value
    for p in PREFIXES:
        if found[p] or per_pos[p]:
            return SpecCounters(**found[p], per_pos=dict(sorted(per_pos[p].items())))
    return None


def metrics_url(base_url: str) -> str:
    """The server root's /metrics: --base-url may be given with or without /v1."""
    base = base_url.rstrip("/")
    return (base[: -len("/v1")] if base.endswith("/v1") else base) + "/metrics"


async def scrape(base_url: str, api_key: str | None = None, timeout_s: float = SCRAPE_TIMEOUT_S) -> SpecCounters | None:
    """None when /metrics is missing, unreachable, slower than timeout_s, not Prometheus text, or has no
    spec_decode counters: a benchmark of a server that exports none must run exactly as before."""
    if timeout_s <= 0:
        return None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            r = await client.get(metrics_url(base_url), headers=headers)
        if r.status_code != 200:
            return None
        return parse_spec_counters(r.text)
    except (httpx.HTTPError, ValueError, KeyError):  # ValueError/KeyError: text the parser cannot read
        return None


@dataclass(frozen=True)
class SpecDecodeSummary:
    """One measured run's figures (None: the server exported no spec_decode counters)."""

    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    spec_mean_acceptance_length: float | None = None
    spec_draft_acceptance_rate: float | None = None
    spec_acceptance_rate_per_pos: list[float] | None = None  # index = draft position

    @staticmethod
    def of(before: SpecCounters | None, after: SpecCounters | None) -> "SpecDecodeSummary":
        if after is None:
            return SpecDecodeSummary()
        d = after.minus(before or SpecCounters())
        drafts = int(round(d.num_drafts))
        return SpecDecodeSummary(
            spec_num_drafts=drafts, spec_num_draft_tokens=int(round(d.num_draft_tokens)),
            spec_num_accepted_tokens=int(round(d.num_accepted_tokens)),
            spec_mean_acceptance_length=1.0 + d.num_accepted_tokens / drafts if drafts else None,
            spec_draft_acceptance_rate=d.num_accepted_tokens / d.num_draft_tokens if d.num_draft_tokens else None,
            spec_acceptance_rate_per_pos=[d.per_pos.get(p, 0.0) / drafts for p in range(max(d.per_pos) + 1)]
            if drafts and d.per_pos else None,
        )

    @property
    def present(self) -> bool:
        return self.spec_num_drafts is not None

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
