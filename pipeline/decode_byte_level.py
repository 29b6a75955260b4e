"""The ByteLevel decode strategy (GPT-2, Qwen, Llama-3, OLMo): byte arithmetic on a token table.

A top-level ByteLevel decoder is lossy UTF-8 over the concatenated bytes of the tokens, a pure
function of the bytes (docs/decode-semantics.md, 'ByteLevel'). Two facts about lossy UTF-8 make
the stream cheap and bounded:

- After a complete character, decoding is context free: once the prefix ends cleanly the left
  context changes no future decision, so the window is just the ids pending since the last
  emission (the *settled* state, `_settle`), and one join plus one decode decide a chunk.
- A byte position the decoder must restart at (the next byte is not a continuation byte, or
  the sequence before it is complete or already broken) splits the text for good: what lies
  before it is final. So a long run of invalid bytes is moved into `held` as it arrives and the
  window keeps at most the last unfinished sequence, re-spelled as single-byte tokens (the
  decode depends only on the bytes). Each pushed id then costs constant work.

Anything else (unknown or malformed ids, a prefix that ends in U+FFFD after an adversarial
prompt) goes through the reference algorithm, with the same self.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from pipeline.decode_reference import ReferenceStream
from pipeline.decode_state import slice_from_byte, utf8_len
from pipeline.vocab_tables import FFFD, TokenizerProfile

# The window is compacted once it holds more ids than this. An unfinished UTF-8 sequence has at
# most 3 bytes, so a compacted window has at most 3 ids; the slack keeps the common case (a
# chunk ending one or two tokens into a character) free of the compaction's join and scan.
COMPACT_ABOVE = 4


def sequence_length(lead: int) -> int:
    """How many bytes the UTF-8 sequence starting with `lead` needs (1 for invalid leads)."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 1


def is_restart(raw: bytes, offset: int) -> bool:
    """Whether lossy decoding of `raw` certainly starts a new character at `offset` (0 < offset).

    True when the byte there is not a continuation byte (a decoder waiting for one gives up and
    restarts on it), or when the sequence begun before it is complete or cannot take more (three
    continuation bytes, or as many bytes as its lead asks for). Conservative: a sequence already
    broken by an invalid second byte may count as unfinished, which only delays a cut.
    """
    if offset < len(raw) and raw[offset] & 0xC0 != 0x80:
        return True
    low = max(offset - 3, 0)
    j = offset - 1
    while j >= low and raw[j] & 0xC0 == 0x80:
        j -= 1
    if j < low:
        return True
    return offset - j >= sequence_length(raw[j])


def last_restart(raw: bytes) -> int:
    """The last offset in (0, len(raw)] where `is_restart` holds, else 0.

    One always lies among the last four offsets of a run of 4+ bytes, so the bytes after it are
    at most 3: an unfinished sequence.
    """
    for offset in range(len(raw), max(len(raw) - 4, 0), -1):
        if is_restart(raw, offset):
            return offset
    return 0


def ends_clean(raw: bytes, end: int) -> bool:
    """Whether lossy UTF-8 of `raw[:end]` is non-empty and does not end in U+FFFD.

    That holds exactly when `raw[:end]` ends with the valid encoding of a character other than
    U+FFFD (a lead byte is never consumed as a continuation, so such an encoding is decoded as
    itself). Looking at the last 4 bytes keeps a scan over a long chunk linear.
    """
    low = max(end - 4, 0)
    j = end - 1
    while j >= low and raw[j] & 0xC0 == 0x80:
        j -= 1
    if j < low:
        return False
    try:
        return raw[j:end].decode("utf-8") != FFFD
    except UnicodeDecodeError:
        return False


class ByteLevelStream(ReferenceStream):
    """Top-level ByteLevel decoders: the settled fast path, with invalid runs moved to `held`."""

    __slots__ = ()

    table: list[bytes | None]  # id -> token bytes (None = unknown) under this skip flag
    # byte -> an id spelling exactly that byte, to re-spell a cut window's unfinished bytes
    # (None if the vocabulary lacks one: then windows are not cut).
    byte_ids: list[int] | None

    @classmethod
    def _class_attributes(cls, profile: TokenizerProfile, skip: bool) -> dict[str, Any]:
        table = profile.byte_table[skip]
        return super()._class_attributes(profile, skip) | {
            "table": table,
            "byte_ids": _single_byte_ids(table, profile.special_ids),
        }

    def push(self, token_ids: Sequence[int]) -> str:
        chunk = token_ids if type(token_ids) is list else list(token_ids)
        table = self.table
        # Validation rides on the table lookup: unknown ids (None) and non-ints raise TypeError,
        # ids past the table IndexError; negative ids would index from the end, hence `min`
        # (which raises ValueError on an empty chunk). Any of those takes the reference path,
        # which validates and reports exactly (and, like here, changes no state before
        # validating). (`itemgetter` fetches a chunk faster than `map(table.__getitem__, ...)`,
        # but returns a bare item, not a tuple, for a single id.)
        try:
            if min(chunk) < 0:
                raw = None
            elif len(chunk) > 1:
                raw = b"".join(itemgetter(*chunk)(table))
            else:
                raw = table[chunk[0]]
        except (TypeError, IndexError, ValueError):
            raw = None
        if raw is None:
            return super().push(chunk)
        self.started = True
        if self.prefix_index:
            return self._push_unsettled(chunk)
        # Settled (see `_settle`): the window is only the ids pending since the last emission,
        # and per-token pushing emits the lossy UTF-8 of their bytes as soon as it does not end
        # in U+FFFD. One join and one decode decide the chunk.
        pending = self.ids
        if pending:
            raw = b"".join(map(table.__getitem__, pending)) + raw
        text = raw.decode("utf-8", "replace")
        if not text.endswith(FFFD):
            if pending:
                self.ids = []
            if self.held and text:
                text = "".join(self.held) + text
                self.held = ()
            return text
        return self._hold_bytes(chunk, raw)

    def _push_unsettled(self, chunk: list[int]) -> str:
        """Push known ids one at a time through the reference path until the state settles.

        Only a prompt whose tail could not be seeded cleanly leaves the prefix ending in U+FFFD;
        the first emission (or a compaction) settles it, and the rest of the chunk takes the
        fast path. One id at a time keeps each decode to a compacted window.
        """
        parts = []
        for position, t in enumerate(chunk):
            parts.append(ReferenceStream.push(self, [t]))
            if not self.prefix_index:
                rest = chunk[position + 1 :]
                if rest:
                    parts.append(self.push(rest))
                break
        return "".join(parts)

    def _hold_bytes(self, chunk: list[int], raw: bytes) -> str:
        """The settled push of a chunk whose text ends in U+FFFD (ends mid-character).

        `raw` is the bytes of pending ids + chunk. Per-token pushing emits, by the chunk's end,
        the text of the last k whose bytes decode non-empty and without a trailing U+FFFD; the
        ids from k on stay pending. Usually k = len(chunk) - 1 (one token into a character).
        """
        table = self.table
        end = len(raw)
        last = len(chunk) - 1
        for k in range(last, 0, -1):
            end -= len(table[chunk[k]])  # type: ignore[arg-type]  # known ids: bytes, not None
            # The first few positions are tried by decoding (the usual case: one token into a
            # character, found at once); past them a 4-byte look keeps a long chunk linear.
            if k > last - 4:
                text = raw[:end].decode("utf-8", "replace")
                if not text or text.endswith(FFFD):
                    continue
            elif ends_clean(raw, end):
                text = raw[:end].decode("utf-8", "replace")
            else:
                continue
            if self.held:
                text = "".join(self.held) + text
                self.held = ()
            self.ids = chunk[k:]
            if len(self.ids) > COMPACT_ABOVE:
                self._cut_settled(raw[end:])
            return text
        self.ids = self.ids + chunk
        if len(self.ids) > COMPACT_ABOVE:
            self._cut_settled(raw)
        return ""

    def _cut_settled(self, raw: bytes) -> None:
        """Settled window with bytes `raw`: move the final text before the last restart to
        `held` and re-spell the unfinished rest (at most 3 bytes) as single-byte ids.

        Exact: lossy(raw + more) = lossy(raw[:r]) + lossy(raw[r:] + more) at a restart r, and
        nothing before r is emitted until the text stops ending in U+FFFD, which only bytes
        after r decide (docs/decode-semantics.md, 'Linear cost').
        """
        byte_ids = self.byte_ids
        if byte_ids is None:
            return
        cut = last_restart(raw)
        if cut:
            self.hold(raw[:cut].decode("utf-8", "replace"))
        self.ids = [byte_ids[b] for b in raw[cut:]]

    def _compact(self) -> None:
        """After a reference-path push: the same cut, settled or not."""
        ids = self.ids
        if len(ids) <= COMPACT_ABOVE or self.byte_ids is None:
            return
        table = self.table
        raw = b"".join(map(table.__getitem__, ids))  # type: ignore[arg-type]  # known ids
        if not self.prefix_index:
            self._cut_settled(raw)
            return
        # Unsettled: the prefix ends in U+FFFD. Cutting at a restart r past the prefix's bytes
        # shifts every later comparison by the same amount, provided the text before r is at
        # least as long as the prefix; what lies beyond the prefix is then held, not emitted.
        prefix_bytes = len(b"".join(map(table.__getitem__, ids[: self.prefix_index])))  # type: ignore[arg-type]
        cut = last_restart(raw)
        if cut < prefix_bytes:
            return
        head = raw[:cut].decode("utf-8", "replace")
        prefix_len = utf8_len(self.prefix)
        if utf8_len(head) < prefix_len:
            return
        held = slice_from_byte(head, prefix_len)
        self.held = [held] if held else ()
        self.ids = [self.byte_ids[b] for b in raw[cut:]]
        self.prefix = ""
        self.prefix_index = 0

    def _settle(self) -> None:
        """Drop the left context once the prefix ends on a clean boundary.

        Lossy UTF-8 is context free after a complete character: if `prefix` (= decode of
        `ids[:prefix_index]`) does not end in U+FFFD, decode(ids + more) is `prefix` followed by
        the decode of `ids[prefix_index:] + more`, so the context changes no future decision and
        the stream is equivalent to window = the pending ids, prefix = "", prefix_index = 0. That
        settled state is what `push`'s fast path runs on, and it keeps snapshots minimal.
        (A prefix ending in a literal U+FFFD is conservatively treated as unclean.)

        An unclean prefix (only a seed whose prompt tail would not decode cleanly) keeps just
        the bytes from its last restart on, re-spelled as single-byte ids: every comparison
        shifts by the same length, so no output changes, and the prompt is not kept.
        """
        if not self.prefix.endswith(FFFD):
            del self.ids[: self.prefix_index]
            self.prefix = ""
            self.prefix_index = 0
            if len(self.ids) > COMPACT_ABOVE:  # a seed whose clean head left a long tail
                self._compact()
            return
        byte_ids = self.byte_ids
        if byte_ids is None or len(self.ids) <= COMPACT_ABOVE:
            return
        table = self.table
        pending = self.ids[self.prefix_index :]
        head = b"".join(map(table.__getitem__, self.ids[: self.prefix_index]))  # type: ignore[arg-type]
        cut = last_restart(head)
        tail = head[cut:]
        self.ids = [byte_ids[b] for b in tail] + pending
        self.prefix = tail.decode("utf-8", "replace")
        self.prefix_index = len(tail)


def _single_byte_ids(table: list[bytes | None], special_ids: frozenset[int]) -> list[int] | None:
    """For each byte value, a non-special id whose token is exactly that byte (None if any lacks
    one; every GPT-2-style vocabulary has all 256)."""
    found: dict[int, int] = {}
    for i, token in enumerate(table):
        if token is not None and len(token) == 1 and i not in special_ids:
            found.setdefault(token[0], i)
    if len(found) < 256:
        return None
    return [found[b] for b in range(256)]
