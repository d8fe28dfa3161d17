"""The planner's settings, checked at start: a bad one is an error before anything runs, naming the flag."""
from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


class PlannerConfigError(ValueError):
    """Settings the planner cannot run with; the message names the flag."""


@dataclass(frozen=True)
class RoleLimits:
    min: int
    max: int


@dataclass(frozen=True)
class PlannerConfig:
    mode: str  # "load" | "sla"
    limits: dict[str, RoleLimits] = field(default_factory=dict)  # role -> its min and max count
    budget: int = 0  # most engine workers at once (the placement's capacity); 0: the sum of the maxima
    interval_s: float = 10.0
    ttft_slo_s: float | None = None  # sla mode
    itl_slo_s: float | None = None
    profile: str | None = None  # the cost-model profile the sla mode predicts from
    speed: float = 1.0  # the profile's speed factor (simulated workers run with --sim-speed)
    # Hysteresis: a role grows after `up_after` intervals in a row that want more of it and shrinks after
    # `down_after` that want fewer, by at most `max_step` workers per decision.
    up_after: int = 1
    down_after: int = 2
    max_step: int = 1
    remote_prefill_threshold: int = 512  # prompts with fewer uncached tokens never reach a prefill worker
    max_num_seqs: int = 128  # the decode workers' batch limit (the load policy's "running" share is of it)

    def __post_init__(self) -> None:
        if self.mode not in ("load", "sla"):
            raise PlannerConfigError(f"--planner must be load or sla, got {self.mode!r}")
        for role in ROLES:
            lim = self.limits.get(role)
            if lim is None:
                raise PlannerConfigError(f"no limits for the {role} role")
            if lim.min < 0:
                raise PlannerConfigError(f"--{role}-min must be >= 0, got {lim.min}")
            if lim.min > lim.max:
                raise PlannerConfigError(f"--{role}-min ({lim.min}) is above --{role}-max ({lim.max})")
        if self.limits["decode"].min < 1:
            raise PlannerConfigError("--decode-min must be >= 1: the mesh needs a decode worker")
        if self.budget < 0:
            raise PlannerConfigError(f"--planner-budget must be >= 0, got {self.budget}")
        if self.budget and self.budget < sum(lim.min for lim in self.limits.values()):
            raise PlannerConfigError(f"--planner-budget {self.budget} cannot hold the minima "
                                     f"({', '.join(f'{r} {self.limits[r].min}' for r in ROLES)})")
        if not self.interval_s > 0:
            raise PlannerConfigError(f"--planner-interval must be > 0, got {self.interval_s}")
        if self.mode == "sla":
            for flag, v in (("--ttft-slo-ms", self.ttft_slo_s), ("--itl-slo-ms", self.itl_slo_s)):
                if v is None:
                    raise PlannerConfigError(f"--planner sla needs {flag}")
                if not v > 0:
                    raise PlannerConfigError(f"{flag} must be > 0, got {v * 1000:g}")
        if self.up_after < 1 or self.down_after < 1 or self.max_step < 1:
            raise PlannerConfigError("hysteresis settings must be >= 1")

    @property
    def capacity(self) -> int:
        return self.budget or sum(lim.max for lim in self.limits.values())
