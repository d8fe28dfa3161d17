"""PNG plots. Uses matplotlib's Figure directly (no pyplot) so no global backend state is touched."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure

from .metrics import Summary


@dataclass(frozen=True)
class Series:
    """One line on a plot: a server (and, for distributions, a concurrency level)."""

    label: str
    concurrency: list[int]
    summaries: list[Summary]
    ttft_ms: list[list[float]]  # per level, raw samples
    itl_ms: list[list[float]]


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path


def _hist(series: list[Series], pick: str, title: str, path: Path) -> Path:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    drawn = 0
    for s in series:
        for conc, samples in zip(s.concurrency, getattr(s, pick)):
            if samples:
                ax.hist(samples, bins=40, histtype="step", linewidth=1.4, label=f"{s.label} c={conc}")
                drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no successful samples", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=8)
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("count")
    ax.set_title(title)
    return _save(fig, path)


def _log2_axis(ax, series: list[Series]) -> None:
    ticks = sorted({c for s in series for c in s.concurrency})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[str(t) for t in ticks])
    ax.set_xlabel("max concurrency")


def _vs_concurrency(series: list[Series], path: Path) -> tuple[Path, Path]:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for s in series:
        ax.plot(s.concurrency, [x.output_throughput for x in s.summaries], marker="o", label=s.label)
    _log2_axis(ax, series)
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput vs concurrency")
    ax.legend(fontsize=8)
    thr = _save(fig, path / "throughput_vs_concurrency.png")

    fig = Figure(figsize=(11, 4.5))
    for i, (name, attr) in enumerate((("TTFT", "ttft_ms"), ("ITL", "itl_ms"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for s in series:
            dists = [getattr(x, attr) for x in s.summaries]
            ax.plot(s.concurrency, [d.median for d in dists], marker="o", label=f"{s.label} p50")
            ax.plot(s.concurrency, [d.p99 for d in dists], marker="x", linestyle="--", label=f"{s.label} p99")
        _log2_axis(ax, series)
        ax.set_ylabel("ms")
        ax.set_title(f"{name} vs concurrency")
        ax.legend(fontsize=8)
    return thr, _save(fig, path / "latency_vs_concurrency.png")


def write_plots(series: list[Series], out_dir: str | Path) -> list[Path]:
    """TTFT and ITL distributions always; throughput/latency vs concurrency when there is a sweep."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _hist(series, "ttft_ms", "Time to first token", out / "ttft_distribution.png"),
        _hist(series, "itl_ms", "Inter-token latency", out / "itl_distribution.png"),
    ]
    if any(len(s.concurrency) > 1 for s in series):
        paths += list(_vs_concurrency(series, out))
    return paths
