"""Stop strings over generated text, in time linear in the text, with the smallest hold-back.

The rule (docs/decode-options.md) is defined on the text T a request would have without stop
strings, so it cannot depend on how the ids were chunked: the stop is at the smallest end
position where some stop string ends in T, and among the strings ending there, the longest.
What a request holds back is the longest suffix of the text so far that is a proper prefix of
some stop string: unlike vLLM's fixed `max(len(stop)) - 1` characters (#11089), text that cannot
begin a stop goes out at once.

Both are read off one Aho-Corasick automaton over the stop list: its state after a text is the
longest suffix of that text that begins some stop, so when no stop ends there it *is* the held
text, and the stops ending there are that suffix's suffixes that are stops (the longest found
once per state, `_out`). A request keeps its state between chunks (`StopScanner`), so each chunk
costs its own characters only. Searching `held + new text` afresh for every string instead
(the regex and `str.find` of before) cost the held window's length times the strings sharing
a prefix per chunk: 64 strings of up to 1,024 characters made a 2,000-token request 40 s.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop found in a searched text: the string and where it starts and ends in that text."""

    stop: str
    start: int
    end: int


class StopMatcher:
    """The automaton of one stop list (shared by every request with the same list).

    Node 0 is the empty prefix; each other node is one prefix of a stop, entered by one
    character (`_chars[node]`). A stop's characters past the prefix it shares with earlier ones
    are consecutive nodes, so a trie of 64 x 1,024 characters is a few flat arrays and a dict
    per branching node, not 65,536 dicts: `_straight[node]` says whether `node + 1` is a child
    of `node`, `_branches` holds every other child.
    """

    __slots__ = (
        "stops",
        "_chars",
        "_straight",
        "_branches",
        "_depth",
        "_fail",
        "_out",
        "_stop_at",
        "_first_at",
    )

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings are a non-empty list of non-empty strings")
        self.stops = tuple(dict.fromkeys(stops))
        chars = ["\0"]  # the root is entered by no character
        depth = array("i", [0])
        straight = bytearray(1)
        self._branches: dict[int, dict[str, int]] = {0: {}}
        self._stop_at: dict[int, str] = {}  # the stop that ends exactly at a node
        for stop in self.stops:
            node, shared = self._walk(stop, chars, straight)
            if shared < len(stop):
                first = len(chars)
                self._branches.setdefault(node, {})[stop[shared]] = first
                chars += stop[shared:]
                depth.extend(range(shared + 1, len(stop) + 1))
                straight += b"\x01" * (len(stop) - shared - 1) + b"\x00"
                node = len(chars) - 1
            self._stop_at[node] = stop
        self._chars = "".join(chars)
        self._straight = straight
        self._depth = depth
        self._fail, self._out = self._links()
        self._first_at = re.compile("[" + "".join(map(re.escape, self._branches[0])) + "]").search

    def _walk(self, stop: str, chars: list[str], straight: bytearray) -> tuple[int, int]:
        """The node of the longest prefix of `stop` already in the trie, and its length."""
        node = 0
        for index, char in enumerate(stop):
            if straight[node] and chars[node + 1] == char:
                node += 1
                continue
            child = self._branches.get(node, {}).get(char)
            if child is None:
                return node, index
            node = child
        return node, len(stop)

    def _child(self, node: int, char: str) -> int:
        """The child of `node` by `char`, or 0 if it has none."""
        if self._straight[node] and self._chars[node + 1] == char:
            return node + 1
        branch = self._branches.get(node)
        return branch.get(char, 0) if branch is not None else 0

    def _links(self) -> tuple[array[int], array[int]]:
        """Each node's failure link (the node of its longest proper suffix in the trie) and
        its output (the node of the longest stop that is a suffix of it, or 0), computed in
        breadth-first order so that every link a node needs is already known."""
        size = len(self._chars)
        fail = array("i", bytes(4 * size))
        out = array("i", bytes(4 * size))
        child = self._child
        level = list(self._branches[0].values())
        for node in level:
            out[node] = node if node in self._stop_at else 0
        while level:
            following = []
            for parent in level:
                kids = list(self._branches.get(parent, {}).values())
                if self._straight[parent]:
                    kids.append(parent + 1)
                for node in kids:
                    char = self._chars[node]
                    link = fail[parent]
                    target = child(link, char)
                    while not target and link:
                        link = fail[link]
                        target = child(link, char)
                    fail[node] = target
                    out[node] = node if node in self._stop_at else out[target]
                following += kids
            level = following
        return fail, out

    def run(self, node: int, text: str) -> tuple[int, int]:
        """Feed `text` to the automaton from `node`: the index in `text` just past the first
        character at which a stop ends (-1 if none) and the node there (or at the end).

        From the root, a text is skipped to its next character that begins some stop by one
        regex search (C speed): text that cannot begin a stop costs no Python step.
        """
        chars, straight, branches = self._chars, self._straight, self._branches
        fail, out, first_at = self._fail, self._out, self._first_at
        roots = branches[0]
        index, size = 0, len(text)
        while index < size:
            if node == 0:
                found = first_at(text, index)
                if found is None:
                    return -1, 0
                index = found.start()
                node = roots[text[index]]
            else:
                char = text[index]
                while True:
                    if straight[node] and chars[node + 1] == char:
                        node += 1
                        break
                    branch = branches.get(node)
                    if branch is not None and char in branch:
                        node = branch[char]
                        break
                    if node == 0:
                        break
                    node = fail[node]
            index += 1
            if out[node]:
                return index, node
        return -1, node

    def match_at(self, node: int, end: int) -> StopMatch:
        """The stop `run` found ending at `end` in node `node`: the longest ending there."""
        stop = self._stop_at[self._out[node]]
        return StopMatch(stop, end - len(stop), end)

    def depth(self, node: int) -> int:
        """The length of the prefix a node stands for."""
        return self._depth[node]


class StopScanner:
    """One request's place in its stop list's automaton, kept between chunks.

    The request's held text (`ActiveRequest.stop_held`, which its snapshot stores) is the
    automaton's state written out: a scanner restored, or handed a held text it did not make,
    finds its node again by scanning `held + text` from the root, which is exactly the search
    the rule asks for; otherwise it goes on from its node over the new text alone.
    """

    __slots__ = ("matcher", "held", "_node")

    def __init__(self, matcher: StopMatcher) -> None:
        self.matcher = matcher
        self.held = ""  # after a scan without a stop: the text to hold back
        self._node = 0

    def scan(self, held: str, text: str) -> StopMatch | None:
        """The stop with the smallest end in `held + text` (the longest of those ending
        there), positions counted in `held + text`; if none, `self.held` becomes the longest
        suffix of `held + text` that is a proper prefix of a stop. Called for every chunk,
        an empty one too: `held` is the request's only after a scan of its latest text."""
        matcher = self.matcher
        if held == self.held:  # as a rule the very object made here: equal without reading it
            offset, node, searched = len(held), self._node, text
        else:
            offset, node, searched = 0, 0, held + text
        end, node = matcher.run(node, searched)
        if end >= 0:
            return matcher.match_at(node, offset + end)
        self._node = node
        kept = matcher.depth(node)
        if kept <= len(text):
            self.held = text[len(text) - kept :] if kept else ""
        else:
            self.held = held[len(held) + len(text) - kept :] + text
        return None


# Requests of one producer usually share a stop list: reuse its matcher. Bounded so that
# producers sending a fresh list per request cannot grow it without limit: in lists, and in
# characters, since an automaton takes about 16 bytes a character (1 MB for a list at the
# schema's bounds, 64 x 1,024: a thousand such lists would be a gigabyte).
_MATCHERS: dict[tuple[str, ...], StopMatcher] = {}
_MAX_CACHED = 1024
_MAX_CACHED_CHARS = 4 * 1024 * 1024


def matcher_for(stops: Sequence[str]) -> StopMatcher:
    """The (cached) matcher of a stop list."""
    key = tuple(stops)
    matcher = _MATCHERS.get(key)
    if matcher is None:
        cached = sum(len(m._chars) for m in _MATCHERS.values())
        if len(_MATCHERS) >= _MAX_CACHED or cached + sum(map(len, key)) > _MAX_CACHED_CHARS:
            _MATCHERS.clear()
        matcher = _MATCHERS[key] = StopMatcher(key)
    return matcher


def scanner_for(stops: Sequence[str]) -> StopScanner:
    """A new request's scanner over the (cached) matcher of its stop list."""
    return StopScanner(matcher_for(stops))
