"""The planner's loop: every interval read the mesh's metrics, ask the policy, apply limits, the budget and
hysteresis, and scale through the Scaler. Every decision is kept with its reason (logged, exported as
Prometheus metrics, and served as JSON by shared/planner/endpoint.py).

Hysteresis: a role grows only after `up_after` intervals in a row wanted more of it, and shrinks only
after `down_after` wanted fewer; each decision moves a role by at most `max_step`. Under a fixed budget
the shrinking role is drained first, so the budget holds at every moment, then the growing one starts.
A failed scale (a worker that died while starting, an orchestrator error) is logged as the decision's
outcome and the next interval starts from the counts the scaler actually has.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.planner.config import ROLES, PlannerConfig
from shared.planner.observe import Observation, Snapshot, observe
from shared.planner.policy import Proposal
from shared.planner.scaler import Scaler

log = logging.getLogger("kvmesh.planner")
PREFIX = "kvmesh:planner_"


@dataclass
class Decision:
    at: float  # wall clock
    mode: str
    before: dict[str, int]
    proposed: dict[str, int]  # what the policy wanted
    target: dict[str, int]  # after limits and budget
    applied: dict[str, int]  # after hysteresis: what the scaler was asked for
    reason: str
    figures: dict[str, float] = field(default_factory=dict)
    outcome: str = "ok"  # or the error the scaler raised

    @property
    def changed(self) -> bool:
        return self.applied != self.before


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.workers = Gauge(PREFIX + "workers", "Workers per role the planner runs", ["role"], registry=r)
        self.target = Gauge(PREFIX + "target_workers", "Workers per role the last decision aimed at (limits and "
                            "budget applied, before hysteresis)", ["role"], registry=r)
        self.decisions = Counter(PREFIX + "scale_events", "Scale decisions applied, by role and direction",
                                 ["role", "direction"], registry=r)
        self.errors = Counter(PREFIX + "scale_errors", "Scale decisions that failed", ["role"], registry=r)
        self.figure = Gauge(PREFIX + "figure", "What the last decision rested on (rates, predictions, "
                            "corrections)", ["name"], registry=r)
        self.ticks = Counter(PREFIX + "intervals", "Intervals evaluated", registry=r)


class Planner:
    def __init__(self, config: PlannerConfig, policy, scaler: Scaler,  # noqa: ANN001 - LoadPolicy | SlaPolicy
                 read: Callable[[], Awaitable[Snapshot]], history: int = 1000, name: str = "planner") -> None:
        self.config = config
        self.name = name  # in its log lines: "planner <model>" where each model of a mesh has its own
        self.policy = policy
        self.scaler = scaler
        self.read = read
        self.metrics = PlannerMetrics()
        self.decisions: deque[Decision] = deque(maxlen=history)
        self._before: Snapshot | None = None
        self._streak = {r: 0 for r in ROLES}  # > 0: intervals in a row wanting more; < 0: fewer
        for role in ROLES:
            self.metrics.workers.labels(role).set(scaler.count(role))

    def counts(self) -> dict[str, int]:
        return {r: self.scaler.count(r) for r in ROLES}

    def bounded(self, wanted: dict[str, int]) -> dict[str, int]:
        """Within each role's limits and the budget: over budget, each role keeps its minimum and the rest is
        shared in proportion to what each wanted."""
        lim = self.config.limits
        out = {r: min(lim[r].max, max(lim[r].min, wanted[r])) for r in ROLES}
        cap = self.config.capacity
        if sum(out.values()) <= cap:
            return out
        spare = cap - sum(lim[r].min for r in ROLES)
        extra = {r: out[r] - lim[r].min for r in ROLES}
        total = sum(extra.values())
        share = {r: math.floor(spare * extra[r] / total) if total else 0 for r in ROLES}
        for r in sorted(ROLES, key=lambda r: -(spare * extra[r] / total - share[r]) if total else 0):
            if sum(share.values()) < spare and share[r] < extra[r]:
                share[r] += 1
        return {r: lim[r].min + share[r] for r in ROLES}

    def hysteresis(self, before: dict[str, int], target: dict[str, int]) -> dict[str, int]:
        c = self.config
        out = dict(before)
        for r in ROLES:
            if target[r] > before[r]:
                self._streak[r] = max(0, self._streak[r]) + 1
                if self._streak[r] >= c.up_after:
                    out[r] = min(target[r], before[r] + c.max_step)
            elif target[r] < before[r]:
                self._streak[r] = min(0, self._streak[r]) - 1
            else:
                self._streak[r] = 0
        # A role shrinks after down_after intervals wanting it (an idle role waits: no flapping), or at once
        # when the budget is full and the other role is ready to grow into the room (a rebalance the load
        # already asked for, as the growing role's own streak shows).
        room = c.capacity - sum(before.values())
        growing = sum(out[r] - before[r] for r in ROLES if out[r] > before[r])
        for r in ROLES:
            if target[r] < before[r] and (-self._streak[r] >= c.down_after or growing > room):
                out[r] = max(target[r], before[r] - c.max_step)
        # The budget holds at every moment: a role grows only into room the other leaves.
        over = sum(out.values()) - c.capacity
        if over > 0:
            for r in ROLES:
                if out[r] > before[r]:
                    cut = min(over, out[r] - before[r])
                    out[r] -= cut
                    over -= cut
        return out

    async def tick(self) -> Decision | None:
        """One interval; None when there was nothing to compare with yet."""
        now = await self.read()
        before_snap, self._before = self._before, now
        self.metrics.ticks.inc()
        if before_snap is None:
            return None
        obs: Observation = observe(now, before_snap)
        before = self.counts()
        if hasattr(self.policy, "settling"):
            self.policy.settling = bool(self.decisions) and self.decisions[-1].changed
        proposal: Proposal = self.policy.propose(obs, before)
        target = self.bounded(proposal.counts)
        applied = self.hysteresis(before, target)
        d = Decision(time.time(), self.config.mode, before, dict(proposal.counts), target, applied, proposal.reason,
                     dict(proposal.figures))
        for r in ROLES:
            self.metrics.target.labels(r).set(target[r])
        for k, v in proposal.figures.items():
            if math.isfinite(v):
                self.metrics.figure.labels(k).set(v)
        if d.changed:
            log.info("%s: %s -> %s (%s)", self.name, _fmt(before), _fmt(applied), proposal.reason)
            # Shrink first, so a fixed budget is never exceeded, then grow.
            for r in sorted(ROLES, key=lambda r: applied[r] - before[r]):
                if applied[r] == before[r]:
                    continue
                try:
                    await self.scaler.scale(r, applied[r])
                    self.metrics.decisions.labels(r, "up" if applied[r] > before[r] else "down").inc()
                except Exception as e:  # noqa: BLE001 - the planner outlives a failed scale; the next interval retries
                    d.outcome = f"scaling {r} to {applied[r]} failed: {e}"
                    self.metrics.errors.labels(r).inc()
                    log.warning("%s: %s", self.name, d.outcome)
        for r in ROLES:
            self.metrics.workers.labels(r).set(self.scaler.count(r))
        self.decisions.append(d)
        return d

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a gateway restarting, a metrics read timing out: try next interval
                log.warning("%s: interval skipped", self.name, exc_info=True)
            next_at += self.config.interval_s
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - loop.time()))
            except asyncio.TimeoutError:
                pass

    def decisions_json(self, limit: int = 100) -> list[dict]:
        return [asdict(d) | {"changed": d.changed} for d in list(self.decisions)[-limit:]]


def _fmt(counts: dict[str, int]) -> str:
    return ", ".join(f"{r} {counts[r]}" for r in ROLES)
