"""The receiving side's transfers, whatever carries their bytes (NATS chunks, a direct socket, shared
memory): what each transfer may write, the checks every chunk passes, and the one future a decode
worker awaits. Every path feeds the same registry, so cancelling or timing out works the same way."""
from __future__ import annotations

import asyncio
import hmac
import time
from dataclasses import dataclass, field

from shared.kv_blocks import KVBlocks

from shared.kv_transport.base import BlockWriter, TransferError


@dataclass
class Incoming:
    num_blocks: int
    write: BlockWriter
    deadline: float
    done: asyncio.Future
    token: bytes = b""  # direct paths must present it (it came to the sender over the locked-down bus)
    seen: set[int] = field(default_factory=set)
    total: int | None = None


class TransferRegistry:
    def __init__(self) -> None:
        self._incoming: dict[str, Incoming] = {}

    def expect(self, transfer_id: str, num_blocks: int, write: BlockWriter, deadline_s: float,
               token: bytes = b"") -> asyncio.Future:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        # Its waiter may be gone by the time it fails (a cancelled admission, a worker going down):
        # the failure is then nobody's to report, not an "exception was never retrieved" at exit.
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._incoming[transfer_id] = Incoming(num_blocks, write, time.monotonic() + deadline_s, done, token)
        loop.call_later(deadline_s, self.fail, transfer_id, "transfer timed out")
        return done

    def forget(self, transfer_id: str) -> None:
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None and not inc.done.done():
            inc.done.cancel()

    def fail(self, transfer_id: str, reason: str) -> None:
        inc = self._incoming.pop(transfer_id, None)
        if inc is not None and not inc.done.done():
            inc.done.set_exception(TransferError(reason))

    def fail_all(self, reason: str) -> None:
        for t in list(self._incoming):
            self.fail(t, reason)

    def authorized(self, transfer_id: object, token: object) -> bool:
        """Whether a direct-channel frame names a registered transfer with its token (checked before
        its payload is read, so a stranger cannot make the receiver allocate anything)."""
        inc = self._incoming.get(transfer_id) if isinstance(transfer_id, str) else None
        return inc is not None and isinstance(token, bytes) and bool(inc.token) and hmac.compare_digest(token, inc.token)

    def check(self, transfer_id: str, seq: int, total: int, block_end: int, token: bytes | None = None
              ) -> tuple[Incoming | None, str | None]:
        """The transfer a chunk belongs to, or why the chunk is refused. token None: the chunk came
        over the bus, whose permissions already say who may push."""
        inc = self._incoming.get(transfer_id)
        if inc is None:
            return None, "unknown transfer"
        if token is not None and not (inc.token and hmac.compare_digest(token, inc.token)):
            return None, "wrong transfer token"
        # total 0: a chunk of a piece sent before the prefill knew how many chunks there would be; the
        # count a final chunk gave bounds every chunk after it.
        known = total or inc.total
        if seq < 0 or total < 0 or (known and seq >= known):
            return None, f"chunk {seq} of {known}"
        if seq in inc.seen:
            return None, f"chunk {seq} received twice"
        if total and inc.total is not None and total != inc.total:
            return None, "chunk count changed mid-transfer"
        if block_end > inc.num_blocks:
            return None, f"blocks up to {block_end} but only {inc.num_blocks} were reserved"
        return inc, None

    async def accept(self, transfer_id: str, inc: Incoming, seq: int, total: int, blocks: KVBlocks) -> str | None:
        """Writes a checked chunk into the reserved blocks; the error that failed the transfer, if any."""
        try:
            await inc.write(blocks)
        except Exception as e:  # noqa: BLE001 - any failure to place blocks fails the transfer
            error = f"could not write blocks: {e}"
            self.fail(transfer_id, error)
            return error
        inc.seen.add(seq)
        if total:
            inc.total = total
        if len(inc.seen) == inc.total and not inc.done.done():
            self._incoming.pop(transfer_id, None)
            inc.done.set_result(None)
        return None

    def refuse(self, transfer_id: str, error: str) -> None:
        """A bad chunk ends its transfer (when it named a real one)."""
        self.fail(transfer_id, error)
