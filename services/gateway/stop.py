"""Stop strings and SGLang's stop regexes, applied to detokenized text as it streams.

Text that might be the start of a stop string is held back until the next tokens show whether
it is, so a stop string spanning several tokens is never partly streamed. The stop string itself
is returned only when asked (vLLM's include_stop_str_in_output, SGLang's no_stop_trim).

A stop regex (RE2, linear in the text it reads: services/gateway/sampling.py) is searched in a bounded
window, the new text plus at most REGEX_WINDOW characters before it, so each token costs the same however
long the answer grows: a match may reach back at most REGEX_WINDOW characters. A regular expression has no
"might still match" prefix to hold back by, so with stop regexes the last REGEX_HOLD characters are held back
while streaming (a match that starts further back than that can only cut what has not gone out yet), and a
whole (non-streamed) answer holds back the whole window, so it is cut exactly where the first match starts.
"""
from __future__ import annotations

from typing import Any

REGEX_WINDOW = 1024  # characters of streamed text a stop regex may reach back into
REGEX_HOLD = 32  # characters held back while streaming with stop regexes


class StopMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False, regexes: list[Any] = (),
                 streaming: bool = True) -> None:
        """regexes: compiled patterns with search(text) -> match | None and .pattern (RE2's, or re's)."""
        self._stops = [s for s in stops if s]
        self._include = include_stop
        self._regexes = list(regexes)
        self._regex_hold = (REGEX_HOLD if streaming else REGEX_WINDOW) if self._regexes else 0
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
        # buf is bounded: what is held back (the longest stop string, or the regex hold) plus the new text.
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
            hold = max(hold, min(len(buf), self._regex_hold))
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
        """Length of the longest suffix of `buf` that is a proper prefix of `stop`. Only positions holding the
        stop's first character are tried, so a long stop string costs about one scan of the tail, not its square."""
        lo = max(0, len(buf) - len(stop) + 1)
        i = buf.find(stop[0], lo)
        while i >= 0:
            if stop.startswith(buf[i:]):
                return len(buf) - i
            i = buf.find(stop[0], i + 1)
        return 0
