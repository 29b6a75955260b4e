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

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop found in a searched text: the string and where it starts and ends in that text."""

    stop: str
    start: int
    end: int


class StopMatcher:
    """The stop strings of one request (shared by every request with the same list)."""

    __slots__ = ("stops", "_firsts")

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings are a non-empty list of non-empty strings")
        # Longest first: of the strings ending at the same position, the longest wins, and a
        # strict `<` on the end position below then keeps the first one seen.
        self.stops = tuple(sorted(set(stops), key=len, reverse=True))
        # (first character, the strings starting with it): a held suffix must begin with one.
        firsts: dict[str, list[str]] = {}
        for stop in self.stops:
            firsts.setdefault(stop[0], []).append(stop)
        self._firsts = tuple((char, tuple(group)) for char, group in firsts.items())

    def find(self, text: str) -> StopMatch | None:
        """The stop with the smallest end in `text`, the longest among those ending there."""
        best: StopMatch | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start >= 0 and (best is None or start + len(stop) < best.end):
                best = StopMatch(stop, start, start + len(stop))
        return best

    def held_length(self, text: str) -> int:
        """Characters of the longest suffix of `text` that is a proper prefix of a stop string.

        Only positions holding a stop's first character can start one, and only within the
        last `len(stop) - 1` characters, so `str.rfind`/`find` skip the rest at C speed; the
        earliest qualifying position over all strings gives the longest suffix.
        """
        size = len(text)
        earliest = size
        for char, group in self._firsts:
            for stop in group:  # longest first: the widest window for this first character
                window = size - len(stop) + 1
                position = text.find(char, max(window, 0), earliest)
                while position >= 0:
                    if stop.startswith(text[position:]):
                        earliest = position
                        break
                    position = text.find(char, position + 1, earliest)
        return size - earliest


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
