"""Error codes and the ErrorReply message: defined by the bus, which sends them for every endpoint."""
from shared.bus.error_reply import (BAD_REQUEST, CANCELLED, INTERNAL, NOT_FOUND, OVERLOADED, TIMEOUT,  # noqa: F401
                                    ErrorReply)
