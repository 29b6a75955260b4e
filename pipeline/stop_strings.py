"""Stop strings over generated text, with the smallest hold-back that keeps deltas honest.

The rule (docs/decode-options.md) is defined on the text T a request would have without stop
strings, so it cannot depend on how the ids were chunked: the stop is at the smallest end
position where some stop string ends in T, and among the strings ending there, the longest. A
caller feeds T piece by piece as `held + new text`, where `held` is what it kept back last time:
the longest suffix of the text so far that is a proper prefix of some stop string. Any stop that
ends in the new text starts inside that window (a longer start would make a longer suffix a
proper prefix of a stop, contradicting "longest"), so searching `held + new` finds exactly the
matches of T, and nothing else ever needs to be kept: unlike vLLM's fixed `max(len(stop)) - 1`
characters (#11089), text that cannot begin a stop goes out at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop found in a searched text: the string and where it starts and ends in that text."""

    stop: str
    start: int
    end: int


class StopMatcher:
    """The stop strings of one request (shared by every request with the same list)."""

    __slots__ = ("stops", "_by_first", "_window", "_any_stop", "_first_at")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings are a non-empty list of non-empty strings")
        # Longest first: of the strings ending at the same position, the longest wins, and a
        # strict `<` on the end position below then keeps the first one seen.
        self.stops = tuple(sorted(set(stops), key=len, reverse=True))
        by_first: dict[str, list[str]] = {}
        for stop in self.stops:
            by_first.setdefault(stop[0], []).append(stop)
        self._by_first = {char: tuple(group) for char, group in by_first.items()}
        # One regex pass settles the common cases at C speed: no stop at all in a text, and no
        # stop's first character within the last `longest - 1` characters (the only place a
        # held suffix can start).
        self._window = len(self.stops[0]) - 1
        self._any_stop = re.compile("|".join(map(re.escape, self.stops))).search
        self._first_at = re.compile("[" + "".join(map(re.escape, by_first)) + "]").search

    def find(self, text: str) -> StopMatch | None:
        """The stop with the smallest end in `text`, the longest among those ending there."""
        if self._any_stop(text) is None:
            return None
        # A regex finds the leftmost start, not the smallest end ("abcd" before "bc" in
        # "abcd"): each string's first occurrence decides.
        best: StopMatch | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or start + len(stop) < best.end):
                best = StopMatch(stop, start, start + len(stop))
        return best

    def held_length(self, text: str) -> int:
        """Characters of the longest suffix of `text` that is a proper prefix of a stop string.

        Candidates are the positions of a stop's first character in the last `longest - 1`
        characters, left to right: the first whose suffix begins a longer stop is the longest.
        """
        size = len(text)
        start = size - self._window
        found = self._first_at(text, start if start > 0 else 0)
        while found is not None:
            position = found.start()
            suffix = text[position:]
            for stop in self._by_first[suffix[0]]:
                if len(stop) > len(suffix) and stop.startswith(suffix):
                    return size - position
            found = self._first_at(text, position + 1)
        return 0


# Requests of one producer usually share a stop list: reuse its matcher. Bounded so that
# producers sending a fresh list per request cannot grow it without limit.
_MATCHERS: dict[tuple[str, ...], StopMatcher] = {}
_MAX_CACHED = 1024


def matcher_for(stops: Sequence[str]) -> StopMatcher:
    """The (cached) matcher of a stop list."""
    key = tuple(stops)
    matcher = _MATCHERS.get(key)
    if matcher is None:
        if len(_MATCHERS) >= _MAX_CACHED:
            _MATCHERS.clear()
        matcher = _MATCHERS[key] = StopMatcher(key)
    return matcher
