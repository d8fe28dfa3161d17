"""Stop strings, applied to detokenized text as it streams.

Text that might be the start of a stop string is held back until the next tokens show whether
it is, so a stop string spanning several tokens is never partly streamed. The stop string
itself is never returned.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def push(self, text: str) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appears."""
        if self.stopped or not text:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self.stopped = True
            self._held = ""
            return buf[:index]
        hold = max((self._partial(buf, s) for s in self._stops), default=0)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """At the end of generation the held text is plain text after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    @staticmethod
    def _partial(buf: str, stop: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
