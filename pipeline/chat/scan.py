"""Finding a region's markers in streamed text, holding back only what could still become one.

A chat format switches region at literal markers (`<think>`, `</tool_call>`, `[TOOL_CALLS]`).
Text arrives in pieces of any size, so a marker can be split across pieces. The rule is the one
stop strings use (pipeline/stop_strings.py): after each piece, keep back the longest suffix of
the unscanned text that is a proper prefix of one of the region's markers, and nothing more.
Everything before it is final for that region. Each character is searched by one regex pass
and looked at again only while it sits in that held-back suffix (shorter than the longest
marker), so the cost per character is constant. Unlike a stop, the marker that counts is the
leftmost one.
"""

from __future__ import annotations

import re
from functools import cache
from typing import NamedTuple


class Hit(NamedTuple):
    """A marker found in a text: which one, and where it starts and ends."""

    marker: str
    start: int
    end: int


class MarkerSet:
    """The markers one region watches for (shared by every stream of a format)."""

    __slots__ = ("markers", "_search", "_prefixes", "_longest")

    def __init__(self, markers: tuple[str, ...]) -> None:
        # Longest first: at one position the regex takes the first alternative that matches.
        self.markers = tuple(sorted(set(markers), key=len, reverse=True))
        self._search = re.compile("|".join(map(re.escape, self.markers))).search
        # Every proper prefix of a marker: a format has a handful of markers of a few dozen
        # characters at most, so the set is small and a suffix test is one hash lookup.
        self._prefixes = frozenset(m[:k] for m in self.markers for k in range(1, len(m)))
        self._longest = max(map(len, self.markers), default=1) - 1

    def held_length(self, text: str) -> int:
        """Characters of the longest suffix of `text` that is a proper prefix of a marker:
        at most the longest marker's length less one lookups, whatever the text's length."""
        prefixes = self._prefixes
        for kept in range(min(len(text), self._longest), 0, -1):
            if text[-kept:] in prefixes:
                return kept
        return 0

    def find(self, text: str, start: int = 0) -> Hit | None:
        """The leftmost marker in `text[start:]` (the longest one starting there)."""
        found = self._search(text, start)
        if found is None:
            return None
        return Hit(found.group(), found.start(), found.end())


@cache
def marker_set(markers: tuple[str, ...]) -> MarkerSet:
    """The (cached) matcher of a tuple of markers: formats are few, their regions fewer."""
    return MarkerSet(markers)
