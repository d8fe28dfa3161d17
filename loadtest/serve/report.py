"""Human-readable tables and the JSON record of a run."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from .load import LevelRun
from .metrics import Summary
from .spec_metrics import SpecDecodeSummary

SCHEMA = "kvmesh.bench.serve/1"


@dataclass
class LevelReport:
    run: LevelRun
    summary: Summary
    spec: SpecDecodeSummary = field(default_factory=SpecDecodeSummary)

    def to_json(self, keep_text: bool = False) -> dict:
        return {
            "max_concurrency": self.run.max_concurrency,
            "request_rate": jsonable_rate(self.run.request_rate),
            "hit_time_limit": self.run.hit_time_limit,
            "summary": self.summary.to_json(),
            "spec_decode": self.spec.to_json(),  # every field None when the server exports no spec_decode counters
            "requests": [r.to_json(keep_text) for r in self.run.results],
        }


@dataclass
class ServeReport:
    target: dict
    eos: dict
    workload: dict
    load: dict
    levels: list[LevelReport] = field(default_factory=list)
    skipped_levels: list[int | None] = field(default_factory=list)

    def to_json(self, keep_text: bool = False) -> dict:
        return {
            "schema": SCHEMA,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "target": self.target,
            "eos": self.eos,
            "workload": self.workload,
            "load": self.load,
            "runs": [lv.to_json(keep_text) for lv in self.levels],
            "skipped_levels": self.skipped_levels,
        }


def jsonable_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def write_json(obj: dict, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, allow_nan=False))
    return p


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def level_table(title: str, s: Summary, spec: SpecDecodeSummary | None = None) -> str:
    rows: list[tuple[str, str]] = [
        ("Requests planned / sent", f"{s.planned} / {s.sent}"),
        ("Successful / failed", f"{s.completed} / {s.failed}"),
        ("Benchmark duration (s)", _f(s.duration_s)),
        ("Total input tokens", str(s.total_input_tokens)),
        ("Total output tokens", f"{s.total_output_tokens} (requested {s.requested_output_tokens})"),
        ("Request throughput (req/s)", _f(s.request_throughput)),
        ("Input token throughput (tok/s)", _f(s.input_throughput)),
        ("Output token throughput (tok/s)", _f(s.output_throughput)),
        ("Total token throughput (tok/s)", _f(s.total_token_throughput)),
    ]
    if s.goodput is not None:
        slo = " ".join(f"{k}:{v:g}ms" for k, v in s.slo_ms.items())
        rows.append((f"Goodput (req/s) [{slo}]", _f(s.goodput)))
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2el_ms)):
        rows.append((f"{name} mean / median (ms)", f"{_f(d.mean)} / {_f(d.median)}"))
        rows.append((f"{name} p90 / p99 (ms)", f"{_f(d.p90)} / {_f(d.p99)}"))
    if spec is not None and spec.present:
        rows.append(("Spec decode drafts / draft tokens", f"{spec.spec_num_drafts} / {spec.spec_num_draft_tokens}"))
        rows.append(("Spec decode accepted tokens", str(spec.spec_num_accepted_tokens)))
        rows.append(("Mean acceptance length", _f(spec.spec_mean_acceptance_length)))
        rows.append(("Draft acceptance rate", _f(spec.spec_draft_acceptance_rate, 3)))
        if spec.spec_acceptance_rate_per_pos:
            rows.append(("Acceptance rate per position", " ".join(f"{r:.3f}" for r in spec.spec_acceptance_rate_per_pos)))
    if s.short_outputs:
        rows.append(("Outputs shorter than requested", f"{s.short_outputs} (server did not honour ignore_eos)"))
    width = max(len(k) for k, _ in rows) + 2
    out = [f"{'=' * 20} {title} {'=' * 20}"]
    out += [f"{k:<{width}}{v}" for k, v in rows]
    for err, n in list(s.errors.items())[:5]:
        out.append(f"  error x{n}: {err}")
    return "\n".join(out)


def grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def sweep_table(levels: list[LevelReport]) -> str:
    header = ["concurrency", "ok/sent", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "E2E p50"]
    spec = any(lv.spec.present for lv in levels)
    if spec:
        header.append("accept len")
    rows = []
    for lv in levels:
        s = lv.summary
        rows.append([
            str(lv.run.max_concurrency or "unbounded"), f"{s.completed}/{s.sent}", _f(s.request_throughput),
            _f(s.output_throughput, 1), _f(s.ttft_ms.median, 1), _f(s.ttft_ms.p99, 1),
            _f(s.itl_ms.median, 1), _f(s.itl_ms.p99, 1), _f(s.e2el_ms.median, 1),
        ] + ([_f(lv.spec.spec_mean_acceptance_length)] if spec else []))
    return grid(header, rows) + "\n(latencies in ms)"
