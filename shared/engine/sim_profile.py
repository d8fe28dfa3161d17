"""The simulated engine's cost model: how long one engine step takes, loaded from a JSON profile.

A step computes some prompt chunks and some decode rows (shared/engine/scheduler.py). Its time is

    base + prefill_token * P + prefill_attention * sum(chunk tokens x their mean context)
         + decode_seq * D + decode_context_token * sum(decode contexts)

divided by a speed factor: the linear terms are the weights' and MLP's cost per token and the
per-row overheads; the two context terms are attention, quadratic for a prompt chunk and linear
in the context for a decode row. The profile is fitted from measured steps (`kvmesh bench
sim-profile` on this CPU) or written from a GPU's figures (shared/engine/sim_profiles/). The planner's SLA
mode predicts TTFT and ITL from the same profile, so both sides read it through this one module.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.engine.errors import ConfigError

FORMAT = "kvmesh-sim-profile/1"


class ProfileError(ConfigError):
    """A profile that cannot be used: names the file and what is wrong with it."""


class StepCoefficients(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_s: float = Field(ge=0)  # a step's fixed cost (launches, sampling, host work)
    prefill_token_s: float = Field(ge=0)  # per prompt token computed
    prefill_attention_s: float = Field(ge=0)  # per (prompt token x context token) of a chunk's attention
    decode_seq_s: float = Field(ge=0)  # per decode row
    decode_context_token_s: float = Field(ge=0)  # per context token a decode row attends to


class Profile(BaseModel):
    """What a profile file holds. kv_tokens: the KV capacity of one worker, in tokens."""

    model_config = ConfigDict(extra="forbid")

    format: str
    name: str
    source: str  # how the numbers were obtained (measured where, or derived from what)
    hardware: str
    model: str
    kv_tokens: int = Field(gt=0)
    max_num_seqs: int = Field(default=256, gt=0)
    step: StepCoefficients
    fit: dict | None = None  # the fit's residuals and samples, when fitted

    def model_post_init(self, _ctx: object) -> None:
        if self.format != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {self.format!r}")


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    prefill_attention: int = 0  # sum over chunks of tokens x mean context
    decode_seqs: int = 0
    decode_context_tokens: int = 0


class CostModel:
    def __init__(self, profile: Profile, speed: float = 1.0) -> None:
        if not speed > 0:
            raise ProfileError(f"the speed factor must be > 0, got {speed}")
        self.profile = profile
        self.speed = speed
        self.c = profile.step

    def step_s(self, shape: StepShape) -> float:
        c = self.c
        t = (c.base_s + c.prefill_token_s * shape.prefill_tokens + c.prefill_attention_s * shape.prefill_attention
             + c.decode_seq_s * shape.decode_seqs + c.decode_context_token_s * shape.decode_context_tokens)
        return t / self.speed

    # What the planner predicts with (shared/planner/): one request's prefill, one decode step.

    def prefill_s(self, prompt_tokens: int, chunk: int = 0) -> float:
        """Time to prefill a prompt alone, in chunks of `chunk` tokens (0: one step)."""
        chunk = chunk or prompt_tokens
        total, done = 0.0, 0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            total += self.step_s(StepShape(prefill_tokens=n, prefill_attention=n * (done + n // 2)))
            done += n
        return total

    def decode_step_s(self, batch: int, mean_context: int) -> float:
        return self.step_s(StepShape(decode_seqs=batch, decode_context_tokens=batch * mean_context))


def load_profile(path: str | Path) -> Profile:
    """Reads and validates a profile file; ProfileError naming the file and the field otherwise."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"cannot read the profile {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"the profile {path} is not JSON: {e}") from None
    try:
        return Profile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise ProfileError(f"the profile {path} is not a {FORMAT} profile: {where}: {err['msg']}") from None


# Profiles shipped with the code; the default is the GPU one, since the simulated engine is for
# mesh-scale and planner studies of GPU meshes.
PROFILES_DIR = Path(__file__).resolve().parent / "sim_profiles"
DEFAULT_PROFILE = PROFILES_DIR / "h100_llama3_8b.json"
