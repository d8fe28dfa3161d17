"""`kvmesh up`'s default layout when the engine workers run on the CPU: one engine process, no prefill worker.

Several CPU engine workers on one machine split its cores (shared/engine/cpu_threads.py: each gets its share,
pinned to its own cores), so a prefill worker beside a decode worker halves the cores decode steps run on. Before
that split they were two OpenMP teams on the same cores, and a team whose cores are taken spin-waits at each
barrier: measured on this project's 2-core CPU (SmolLM2 Q4_1, batch-1 decode in process, while other jobs used
the cores): 186 and 258 ms a token with 2 threads against 50 and 25 with 1 in the same runs. Either way a remote
prefill on the same CPU takes cores from decode instead of work off it, and an idle prefill worker still holds a
second copy of the model. The decode worker prefills locally
(chunked inside its batch), which is what a prefill worker would compute, on the same cores, without the KV
transfer. Asking for prefill workers (`--prefill N`) keeps the mesh as given.
"""
from __future__ import annotations

from dataclasses import replace

from shared.launcher.process_spec import MeshOptions

CPU_LAYOUT_NOTE = ("[kvmesh] engine workers on CPU: no prefill worker by default (decode prefills locally; a prefill "
                   "worker would compute on the same cores as decode and slow its steps); --prefill N starts them")


def cpu_default_layout(opts: MeshOptions, prefill_given: bool, planned: bool) -> tuple[MeshOptions, str | None]:
    """The options to start with and the line to log, or (opts, None) when the layout stays as it is: GPU workers,
    simulated workers (no model computes), a --prefill the user gave, or a planner that scales prefill itself."""
    if opts.devices or opts.engine != "real" or prefill_given or planned or opts.total("prefill") == 0:
        return opts, None
    return opts.with_models(tuple(replace(m, prefill=0) for m in opts.models)), CPU_LAYOUT_NOTE
