"""Stop sequences, applied to the answer's text as it is detokenized (the engine knows only token ids).

A stop string can span tokens ("\\n\\n" from two "\\n" tokens, "END" from "E" + "ND"), so it is matched
on text, never on ids. The matcher holds back the last len(longest stop) - 1 characters: text that
might be the start of a stop string is not shown until the next piece proves it is not. When one
appears, everything from it on is dropped; the caller cancels the engine request, and the answer
ends with finish_reason "stop" (as OpenAI's does: the stop string itself is not in the answer).
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        self.stops = tuple(stops)
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.pending = ""  # received, not yet released
        self.released = ""  # everything released so far: the answer's text
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be shown now ("" while it might be the start of a stop string)."""
        if self.stopped or not piece:
            return ""
        self.pending += piece
        found = [index for index in (self.pending.find(stop) for stop in self.stops) if index != -1]
        if found:
            self.stopped = True
            return self._release(self.pending[: min(found)], keep="")
        if len(self.pending) <= self.hold:
            return ""
        cut = len(self.pending) - self.hold
        return self._release(self.pending[:cut], keep=self.pending[cut:])

    def flush(self) -> str:
        """At the end without a stop: whatever was held back is the answer's last text."""
        if self.stopped:
            return ""
        return self._release(self.pending, keep="")

    def _release(self, text: str, *, keep: str) -> str:
        self.pending = keep
        self.released += text
        return text
