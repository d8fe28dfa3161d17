"""How many prefill and decode workers the next interval wants, and why.

load: thresholds on what the workers report (as Dynamo's load planner: prefill queue per worker, decode KV
  usage and running requests per worker): one more when a role is saturated, one fewer when it idles.
sla: predicts TTFT and ITL from the cost-model profile (shared/engine/sim_profile.py) for the observed
  request rate and lengths, corrected by the ratio of observed to predicted latency, and picks the fewest
  workers per role that meet --ttft-slo-ms and --itl-slo-ms.
Both return a Proposal; the planner (planner.py) applies limits, the budget and hysteresis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shared.engine.sim_profile import CostModel
from shared.planner.observe import Observation


@dataclass(frozen=True)
class Proposal:
    counts: dict[str, int]  # role -> wanted workers (before limits and hysteresis)
    reason: str
    figures: dict[str, float]  # what the decision rested on (exported and logged)


@dataclass(frozen=True)
class LoadThresholds:
    prefill_queue_up: float = 2.0  # requests waiting per prefill worker that call for one more
    prefill_queue_down: float = 0.2
    decode_kv_up: float = 0.85  # mean KV usage of the decode workers that calls for one more
    decode_kv_down: float = 0.4
    decode_running_up: float = 0.9  # running per decode worker, as a share of max_num_seqs
    decode_running_down: float = 0.3
    max_num_seqs: int = 128


class LoadPolicy:
    def __init__(self, thresholds: LoadThresholds = LoadThresholds()) -> None:
        self.t = thresholds

    def propose(self, obs: Observation, current: dict[str, int]) -> Proposal:
        t = self.t
        counts = dict(current)
        why = []
        p_workers = max(1, obs.workers.get("prefill", current["prefill"]))
        queue = (obs.waiting.get("prefill", 0.0) + obs.running.get("prefill", 0.0)) / p_workers
        if queue > t.prefill_queue_up:
            counts["prefill"] += 1
            why.append(f"prefill queue {queue:.1f}/worker > {t.prefill_queue_up:g}")
        elif queue < t.prefill_queue_down:
            counts["prefill"] -= 1
            why.append(f"prefill queue {queue:.1f}/worker < {t.prefill_queue_down:g}")
        d_workers = max(1, obs.workers.get("decode", current["decode"]))
        kv = obs.kv_usage.get("decode", 0.0)
        running = obs.running.get("decode", 0.0) / d_workers / t.max_num_seqs
        waiting = obs.waiting.get("decode", 0.0) / d_workers
        if kv > t.decode_kv_up or running > t.decode_running_up or waiting > 1.0:
            counts["decode"] += 1
            why.append(f"decode KV {kv:.0%}, running {running:.0%} of max_num_seqs, {waiting:.1f} waiting/worker")
        elif kv < t.decode_kv_down and running < t.decode_running_down and waiting == 0:
            counts["decode"] -= 1
            why.append(f"decode KV {kv:.0%} < {t.decode_kv_down:.0%}, running {running:.0%}")
        return Proposal(counts, "; ".join(why) or "within thresholds",
                        {"prefill_queue_per_worker": queue, "decode_kv_usage": kv, "decode_running_share": running})


def max_utilization(service_s: float, slo_s: float) -> float:
    """The busiest a server may be and keep mean time-in-system under slo_s (M/D/1: wait = rho/(2(1-rho)) x
    service); 0 when even an idle server misses it."""
    k = slo_s / service_s if service_s > 0 else math.inf
    if k <= 1:
        return 0.0
    if math.isinf(k):
        return 0.95
    return min(0.95, 2 * (k - 1) / (1 + 2 * (k - 1)))


class SlaPolicy:
    def __init__(self, cost: CostModel, ttft_slo_s: float, itl_slo_s: float, prefill_chunk: int = 1024,
                 remote_prefill_threshold: int = 512, headroom: float = 0.8, smoothing: float = 0.5) -> None:
        self.cost = cost
        self.ttft_slo_s = ttft_slo_s
        self.itl_slo_s = itl_slo_s
        self.chunk = prefill_chunk
        self.threshold = remote_prefill_threshold
        self.headroom = headroom  # plan for this share of each SLO: room for noise and bursts
        self.smoothing = smoothing  # weight of the newest observation in the corrections and the load
        self.ttft_correction = 1.0
        self.itl_correction = 1.0
        # Set by the planner for the interval after a scale event: the mesh was in transition (a drained
        # worker's requests re-prefilling elsewhere), so its latencies say nothing about the profile's error.
        self.settling = False
        self._rate: float | None = None
        self._isl: float | None = None
        self._osl: float | None = None

    def _smooth(self, old: float | None, new: float | None) -> float | None:
        if new is None:
            return old
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    # --- predictions ----------------------------------------------------------------------------

    def prefill_service_s(self, isl: float) -> float:
        return self.cost.prefill_s(max(1, int(isl)), self.chunk)

    def predict_ttft_s(self, rate: float, isl: float, workers: int) -> float:
        service = self.prefill_service_s(isl)
        rho = rate * service / max(1, workers)
        if rho >= 1:
            return math.inf
        return service * (1 + rho / (2 * (1 - rho)))

    def decode_batch(self, rate: float, osl: float, ctx: float, workers: int) -> float:
        """Requests per decode worker: Little's law, each one staying osl steps of the step time its batch gives."""
        b = 1.0
        for _ in range(50):
            b_next = rate * osl * self.cost.decode_step_s(max(1, round(b)), int(ctx)) / max(1, workers)
            if abs(b_next - b) < 0.01:
                break
            b = b_next
            if b > 1e6:
                return math.inf
        return max(b, 0.0)

    def predict_itl_s(self, rate: float, isl: float, osl: float, workers: int) -> float:
        ctx = isl + osl / 2
        b = self.decode_batch(rate, osl, ctx, workers)
        if math.isinf(b):
            return math.inf
        return self.cost.decode_step_s(max(1, math.ceil(b)), int(ctx))

    # --- the decision ---------------------------------------------------------------------------

    def propose(self, obs: Observation, current: dict[str, int]) -> Proposal:
        if obs.finished > 0 or obs.arrived > 0:
            self._rate = self._smooth(self._rate, obs.arrival_rate)
        self._isl = self._smooth(self._isl, obs.mean_isl)
        self._osl = self._smooth(self._osl, obs.mean_osl)
        rate, isl, osl = self._rate, self._isl, self._osl
        if rate is None or isl is None or osl is None:
            return Proposal(dict(current), "no finished requests yet: keeping the counts", {})
        remote = isl >= self.threshold
        # Corrections: what the mesh measured over what the profile predicts for the counts it ran with.
        p_now, d_now = obs.workers.get("prefill", current["prefill"]), obs.workers.get("decode", current["decode"])
        ttft = obs.ttft.mean
        predicted_ttft = self.predict_ttft_s(rate, isl, p_now) if remote and p_now else None
        if ttft is not None and predicted_ttft and math.isfinite(predicted_ttft) and not self.settling:
            self.ttft_correction = self._smooth(self.ttft_correction, min(4.0, max(0.5, ttft / predicted_ttft)))
        itl = obs.itl.mean
        predicted_itl = self.predict_itl_s(rate, isl, osl, d_now) if d_now else None
        if itl is not None and predicted_itl and math.isfinite(predicted_itl) and not self.settling:
            self.itl_correction = self._smooth(self.itl_correction, min(4.0, max(0.5, itl / predicted_itl)))
        # Prefill: the fewest workers whose predicted TTFT (corrected) stays within the headroom of the SLO.
        ttft_target = self.ttft_slo_s * self.headroom
        prefill = 0
        if remote:
            service = self.prefill_service_s(isl) * self.ttft_correction
            rho = max_utilization(service, ttft_target)
            prefill = math.ceil(rate * service / rho) if rho > 0 else current["prefill"] + 1
        # Decode: the fewest workers whose batch keeps the predicted step (corrected) within the ITL SLO and
        # whose KV holds that batch.
        itl_target = self.itl_slo_s * self.headroom
        ctx = isl + osl
        kv_cap = self.cost.profile.kv_tokens
        decode = None
        # What the decode workers run now (from their beats) is demand too: under overload it is larger than
        # Little's law over the served rate says.
        held = obs.running.get("decode", 0.0)
        for n in range(1, 1025):
            b = max(self.decode_batch(rate, osl, isl + osl / 2, n), held / n)
            if math.isinf(b):
                continue
            step = self.cost.decode_step_s(max(1, math.ceil(b)), int(isl + osl / 2)) * self.itl_correction
            if step <= itl_target and b * ctx <= 0.9 * kv_cap and b <= self.cost.profile.max_num_seqs:
                decode = n
                break
        if decode is None:
            decode = current["decode"] + 1
        figures = {"rate_rps": rate, "isl": isl, "osl": osl, "ttft_correction": self.ttft_correction,
                   "itl_correction": self.itl_correction,
                   "predicted_ttft_s": self.predict_ttft_s(rate, isl, max(1, prefill)) * self.ttft_correction
                   if remote else 0.0,
                   "predicted_itl_s": self.predict_itl_s(rate, isl, osl, decode) * self.itl_correction}
        reason = (f"{rate:.2f} req/s of ~{isl:.0f} in/{osl:.0f} out: prefill {prefill} "
                  f"{'(prompts below the remote threshold: none)' if not remote else ''}for TTFT <= "
                  f"{ttft_target * 1000:.0f} ms (x{self.ttft_correction:.2f} observed/predicted), decode {decode} for "
                  f"ITL <= {itl_target * 1000:.0f} ms (x{self.itl_correction:.2f})")
        return Proposal({"prefill": prefill, "decode": decode}, reason, figures)
