"""Finding a region's markers in streamed text, holding back only what could still become one.

A chat format switches region at literal markers (`<think>`, `</tool_call>`, `[TOOL_CALLS]`).
Text arrives in pieces of any size, so a marker can be split across pieces. The rule is the one
stop strings use (pipeline/stop_strings.py): after each piece, keep back the longest suffix of
the unscanned text that is a proper prefix of one of the region's markers, and nothing more.
Everything before it is final for that region. Each character is searched by one regex pass
and looked at again only while it sits in that held-back suffix (shorter than the longest
marker), so the cost per character is constant.
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

    __slots__ = ("markers", "_search", "_first_at", "_window", "_by_first")

    def __init__(self, markers: tuple[str, ...]) -> None:
        # Longest first: at one position the regex takes the first alternative that matches.
        self.markers = tuple(sorted(set(markers), key=len, reverse=True))
        self._search = re.compile("|".join(map(re.escape, self.markers))).search
        firsts = sorted({m[0] for m in self.markers})
        self._first_at = re.compile("[" + "".join(map(re.escape, firsts)) + "]").search
        self._window = len(self.markers[0]) - 1
        by_first: dict[str, list[str]] = {}
        for marker in self.markers:
            by_first.setdefault(marker[0], []).append(marker)
        self._by_first = {char: tuple(group) for char, group in by_first.items()}

    def find(self, text: str, start: int = 0) -> Hit | None:
        """The leftmost marker in `text[start:]` (the longest one starting there)."""
        found = self._search(text, start)
        if found is None:
            return None
        return Hit(found.group(), found.start(), found.end())

    def held_length(self, text: str) -> int:
        """Characters of the longest suffix of `text` that is a proper prefix of a marker."""
        size = len(text)
        found = self._first_at(text, max(0, size - self._window))
        while found is not None:
            position = found.start()
            suffix = text[position:]
            for marker in self._by_first[suffix[0]]:
                if len(marker) > len(suffix) and marker.startswith(suffix):
                    return size - position
            found = self._first_at(text, position + 1)
        return 0


@cache
def marker_set(markers: tuple[str, ...]) -> MarkerSet:
    """The (cached) matcher of a tuple of markers: formats are few, their regions fewer."""
    return MarkerSet(markers)
