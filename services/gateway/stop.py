"""Stop strings and SGLang's stop regexes, applied to detokenized text as it streams.

Text that might be the start of a stop string is held back until the next tokens show whether
it is, so a stop string spanning several tokens is never partly streamed. The stop string itself
is returned only when asked (vLLM's include_stop_str_in_output, SGLang's no_stop_trim).

A stop regex is searched in the text so far (the last REGEX_WINDOW characters already out plus the new
text). A regular expression has no "might still match" prefix to hold back by, so with stop regexes the
last REGEX_HOLD characters are held back while streaming (a match that starts further back than that can
only cut what has not gone out yet), and a whole (non-streamed) answer holds everything back until the end,
so it is cut exactly where the first match starts.
"""
from __future__ import annotations

import re

REGEX_WINDOW = 1024  # characters of streamed text a stop regex may reach back into
REGEX_HOLD = 32  # characters held back while streaming with stop regexes


class StopMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False, regexes: list[re.Pattern[str]] = (),
                 streaming: bool = True) -> None:
        self._stops = [s for s in stops if s]
        self._include = include_stop
        self._regexes = list(regexes)
        self._regex_hold = (REGEX_HOLD if streaming else None) if self._regexes else 0
        self._held = ""
        self._tail = ""  # the last REGEX_WINDOW characters emitted (context for the regexes)
        self.stopped = False
        self.matched: str | None = None  # the stop string (or regex pattern) that ended the text

    @property
    def active(self) -> bool:
        """Whether there is any stop string or stop regex to look for."""
        return bool(self._stops or self._regexes)

    def push(self, text: str, armed: bool = True) -> str:
        """Returns the text that is safe to emit; sets `stopped` when a stop string appears. Not `armed`
        (min_tokens not yet reached: vLLM looks for stop strings only after them), the text passes as is."""
        if self.stopped or not text:
            return ""
        if not armed:
            return self._emit(self.flush() + text)
        if not self._stops and not self._regexes:
            return text
        buf = self._held + text
        # (start, end, what) in buf; a regex match reaching into streamed text starts at 0 (the rest is out).
        hits = [(i, i + len(s), s) for s in self._stops if (i := buf.find(s)) >= 0]
        if self._regexes:
            ctx = self._tail + buf
            for r in self._regexes:
                m = r.search(ctx)
                if m is not None and m.end() > len(self._tail):
                    hits.append((max(0, m.start() - len(self._tail)), m.end() - len(self._tail), r.pattern))
        if hits:
            start, end, self.matched = min(hits, key=lambda h: (h[0], h[1]))
            self.stopped = True
            self._held = ""
            return self._emit(buf[:end] if self._include else buf[:start])
        hold = max((self._partial(buf, s) for s in self._stops), default=0)
        if self._regex_hold != 0:
            hold = max(hold, len(buf) if self._regex_hold is None else min(len(buf), self._regex_hold))
        self._held = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold])

    def flush(self) -> str:
        """At the end of generation the held text is plain text after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _emit(self, text: str) -> str:
        if self._regexes:
            self._tail = (self._tail + text)[-REGEX_WINDOW:]
        return text

    @staticmethod
    def _partial(buf: str, stop: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of `stop`."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
