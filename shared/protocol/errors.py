"""Error codes and the ErrorReply message: defined by the bus, which sends them for every endpoint."""
from shared.bus.error_reply import (BAD_REQUEST, CANCELLED, INTERNAL, NOT_FOUND, OVERLOADED, TIMEOUT,  # noqa: F401
                                    ErrorReply)

# The error text of a decode worker's last chunk when it leaves with the request unfinished (drained by the
# planner, or shut down past its grace period): the gateway continues the request on another worker (a
# migration, as when a worker dies), so the client loses nothing.
MOVE_ELSEWHERE = "worker draining: continue on another worker"
