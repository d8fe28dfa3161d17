"""A mesh worker's follower rank (tensor parallelism): `python -m services.tp_rank ...`, started by the worker's
engine (shared/engine/tp/launch.py) with the arguments of shared/engine/tp/worker_main.py.

The rank's compute is the engine's; this is where it meets the mesh's data plane, so each rank can send and
receive its KV head shard directly (shared/engine/tp/shard_link.py) over the direct channel."""
from __future__ import annotations

import sys

from shared.engine.tp.worker_main import main
from shared.kv_transport.shard_transport import DirectShardTransport

if __name__ == "__main__":
    sys.exit(main(shard_transport=DirectShardTransport))
