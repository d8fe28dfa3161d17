"""`kvmesh up --planner`: the planner beside the supervisor, reading the gateway's /metrics, scaling through a
SupervisorScaler, with its /metrics and /decisions endpoint."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shared.planner.config import PlannerConfig
from shared.planner.endpoint import PlannerEndpoint
from shared.planner.observe import GatewayMetrics
from shared.planner.planner import Planner
from shared.planner.policy import LoadPolicy, LoadThresholds, SlaPolicy
from shared.planner.scaler import Scaler


def build_policy(config: PlannerConfig):  # noqa: ANN201 - LoadPolicy | SlaPolicy
    if config.mode == "load":
        return LoadPolicy(LoadThresholds(max_num_seqs=config.max_num_seqs))
    from shared.engine.sim_profile import CostModel, load_profile

    assert config.profile and config.ttft_slo_s and config.itl_slo_s
    return SlaPolicy(CostModel(load_profile(config.profile), config.speed), config.ttft_slo_s, config.itl_slo_s,
                     remote_prefill_threshold=config.remote_prefill_threshold)


class RunningPlanner:
    def __init__(self, planner: Planner, endpoint: PlannerEndpoint, reader: GatewayMetrics) -> None:
        self.planner, self.endpoint, self.reader = planner, endpoint, reader
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(planner.run(self._stop), name="planner")

    async def close(self) -> None:
        self._stop.set()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.endpoint.stop()
        await self.reader.close()


async def start_planner(config: PlannerConfig, scaler: Scaler, metrics_url: str, host: str, port: int,
                        emit: Callable[[str], None], model: str | None = None) -> RunningPlanner:
    """model: plan that served model's workers from its own series (a mesh of several models has a planner
    per model); None: the mesh's one model."""
    # The planner's decisions go to the launcher's output like the services' lines.
    log = logging.getLogger("kvmesh.planner")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[planner] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    reader = GatewayMetrics(metrics_url, model=model)
    planner = Planner(config, build_policy(config), scaler, reader, name=f"planner {model}" if model else "planner")
    endpoint = PlannerEndpoint(planner, host if host not in ("0.0.0.0", "::", "") else "127.0.0.1", port)
    url = await endpoint.start()
    lim = config.limits
    emit(f"[kvmesh] planner{f' for {model}' if model else ''} ({config.mode}) every {config.interval_s:g}s: prefill {lim['prefill'].min}..{lim['prefill'].max}, "
         f"decode {lim['decode'].min}..{lim['decode'].max}, at most {config.capacity} engine workers; decisions at "
         f"{url}/decisions, metrics at {url}/metrics")
    return RunningPlanner(planner, endpoint, reader)
