"""The Llama-2 SentencePiece decode strategy: `Replace(▁→' '), ByteFallback, Fuse, Strip(' ',1,0)`.

While the bytes of window + chunk are valid UTF-8, the chain is the strict decode of the pieces'
concatenation with one leading space stripped, and it is append-monotonic: the per-token
emission points follow from byte offsets alone (`_push_spm`, `_emission_point`), with no probe
(docs/decode-semantics.md, 'SentencePiece byte fallback').

An invalid byte run is not append-monotonic (ByteFallback turns the whole run into one U+FFFD
per byte token), so it goes through the reference algorithm, per token. Once a run is *dead*
(its bytes are invalid whatever follows), its text is final: one U+FFFD per byte token, and so
is every further byte token of the run. `_compact` then moves that text to `held` and replaces
the run by one always-invalid byte token, which reproduces every later decode exactly, so the
window stays a few ids however long the run grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Any

from pipeline.decode_reference import SAFE_SUFFIX_MAX, ReferenceStream
from pipeline.decode_state import slice_from_byte, utf8_len
from pipeline.vocab_tables import EMPTY_TOKEN_PIECE, FFFD, TokenizerProfile

# Compaction looks at the window only once it holds more ids than this: an unfinished character
# is at most 3 byte tokens, so a shorter window is cheap to decode and needs no cut.
COMPACT_ABOVE = 8

# Bytes that never occur in valid UTF-8: a byte token for one of these starts a dead run.
NEVER_VALID = bytes([0xC0, 0xC1, *range(0xF5, 0x100)])


class SpmByteFallbackStream(ReferenceStream):
    """The Llama-2 chain: byte-offset arithmetic while the bytes are valid, dead runs held."""

    __slots__ = ()

    table: list[bytes | None]  # id -> piece bytes (None = unknown); see `TokenizerProfile`
    dead_id: int | None  # a byte token that is never valid UTF-8 (e.g. `<0xFF>`), if any

    @classmethod
    def _class_attributes(cls, profile: TokenizerProfile, skip: bool) -> dict[str, Any]:
        table = profile.spm_table[skip]
        dead_id = next(
            (
                i
                for i, piece in enumerate(table)
                if profile.byte_token[i]
                and piece is not None
                and len(piece) == 1
                and piece in NEVER_VALID
            ),
            None,
        )
        return super()._class_attributes(profile, skip) | {"table": table, "dead_id": dead_id}

    def push(self, token_ids: Sequence[int]) -> str:
        chunk = token_ids if type(token_ids) is list else list(token_ids)
        if chunk:
            text = self._push_spm(chunk)
            if text is not None:
                return text
        return super().push(chunk)

    def _push_spm(self, chunk: list[int]) -> str | None:
        """The chain's push in byte arithmetic, or None to take the reference path.

        While the bytes of window + chunk are valid UTF-8 (possibly missing the end of a last
        character) and hold no literal U+FFFD, per-token pushing emits exactly at the *emission
        points*: positions whose byte offset is a character boundary and beyond the last
        emission (see `_emission_point`). Its window after the chunk is the ids from the
        second-to-last emission point on, with `prefix` the decode of those up to the last one:
        this computes that state directly, with no probes. It needs the context text to be
        non-empty (so the Strip already happened there) and clean; invalid byte runs, literal
        U+FFFD and unknown ids take the reference path.
        """
        table = self.table
        try:
            if min(chunk) < 0:  # negative ids would index the table from the end
                return None
            # (`itemgetter` returns a bare item, not a tuple, for a single id.)
            fresh = itemgetter(*chunk)(table) if len(chunk) > 1 else (table[chunk[0]],)
            fresh_raw = b"".join(fresh)  # an unknown id (None) raises TypeError here
        except (TypeError, IndexError):  # not an int, past the table, or unknown
            return None
        ids = self.ids
        prefix_index = self.prefix_index
        if not prefix_index or self.prefix.endswith(FFFD):
            return None
        self.started = True
        base = len(ids)
        held = itemgetter(*ids)(table) if base > 1 else (table[ids[0]],)
        raw = b"".join(held) + fresh_raw
        ends = list(accumulate(map(len, held + fresh)))  # ends[i]: byte offset after id i
        floor = ends[prefix_index - 1]
        if not floor:
            return None
        try:
            text = raw.decode("utf-8")
            complete = len(raw)
        except UnicodeDecodeError as error:
            if error.reason != "unexpected end of data":
                return None  # an invalid run: U+FFFDs, not append-monotonic
            complete = error.start  # bytes beyond: the start of an unfinished last character
            text = raw[:complete].decode("utf-8")
        if FFFD in text:
            return None
        size = len(ends)
        last = _emission_point(ends, raw, complete, base, size, floor)
        if last is None:
            self.ids = ids + chunk
            if len(self.ids) > COMPACT_ABOVE:
                self._compact()
            return ""
        before = _emission_point(ends, raw, complete, base, last - 1, floor)
        start = prefix_index if before is None else before
        first, stop = ends[start - 1], ends[last - 1]
        if text.isascii():  # byte offsets are character offsets
            prefix, new = text[first:stop], text[floor:stop]
        else:
            prefix, new = raw[first:stop].decode("utf-8"), raw[floor:stop].decode("utf-8")
        self.ids = chunk[start - base :] if start >= base else ids[start:] + chunk
        self.prefix = prefix[1:] if prefix[:1] == " " else prefix
        self.prefix_index = last - start
        return new

    def _compact(self) -> None:
        """Drop skipped specials behind the prefix; then, if the window ends in a dead byte run,
        hold its text and replace the run by one always-invalid byte token.

        Exact: with the run dead, decode(window + more) = decode(window)[:-1] + decode([dead] +
        more) for every continuation (the run's U+FFFDs are one per byte token either way, and
        the leading-space Strip has already happened, or happens in the held part). As in the
        reference algorithm, nothing is emitted while the text ends in U+FFFD, so the held text
        waits; it needs to reach at least the prefix's length for the comparisons to carry over.
        """
        if len(self.ids) <= COMPACT_ABOVE:
            return
        super()._compact()
        dead = self.dead_id
        ids = self.ids
        if dead is None or len(ids) <= COMPACT_ABOVE:
            return
        if not self._ends_in_dead_run(ids):
            return
        text = self.decode_one_now(ids)
        head = text[:-1]  # the run's last U+FFFD is kept, spelled by the dead token
        prefix_len = utf8_len(self.prefix)
        if utf8_len(head) < prefix_len:
            return
        held = slice_from_byte(head, prefix_len)
        if held:
            self.hold(held)
        self.ids = [dead]
        self.prefix = ""
        self.prefix_index = 0

    def _ends_in_dead_run(self, ids: list[int]) -> bool:
        """Whether `ids` ends in a byte run whose bytes are invalid whatever follows (the run's
        text is one U+FFFD per byte token, now and after any continuation)."""
        if self.dead_id is None:
            return False
        byte_token = self.profile.byte_token
        table = self.table
        run = bytearray()
        k = len(ids) - 1
        # Skipped specials vanish before the decoder runs: the run goes on across them.
        while k >= 0 and (byte_token[ids[k]] or not table[ids[k]]):
            run += table[ids[k]]  # type: ignore[operator]  # known ids: bytes
            k -= 1
        if not run:
            return False
        run.reverse()
        try:
            run.decode("utf-8")
        except UnicodeDecodeError as error:
            return error.reason != "unexpected end of data"
        return False

    def _settle(self) -> None:
        """A long seeded context (the full-prompt fallback): keep it from its last text piece on.

        At a visible non-byte token t with text, the chain splits: decode(ids + more) =
        A + decode(ids[t:] + more), with A independent of `more` (t ends any byte run before it,
        and the leading-space Strip happens before or at t either way). So the context before t
        changes no comparison, only shifts them all by len(A).
        """
        ids = self.ids
        if len(ids) > SAFE_SUFFIX_MAX and self.prefix_index >= 2:
            self._cut_context(ids)
        # A seed whose clean head left a tail behind it (a dead run, say): the same compaction
        # as after a push. Its held text is prompt text, emitted only once a token is pushed.
        self._compact()

    def _cut_context(self, ids: list[int]) -> None:
        if self.prefix_index == len(ids) and self._ends_in_dead_run(ids):
            # The prefix covers a window ending in a dead run: decode(ids + more) =
            # prefix[:-1] + decode([dead] + more), so one dead token with its U+FFFD as prefix
            # shifts every comparison by the same length.
            self.ids = [self.dead_id]  # type: ignore[list-item]  # set when a run can be dead
            self.prefix = FFFD
            self.prefix_index = 1
            return
        table = self.table
        byte_token = self.profile.byte_token
        for k in range(self.prefix_index - 1, 0, -1):
            piece = table[ids[k]]
            if piece and piece != EMPTY_TOKEN_PIECE and not byte_token[ids[k]]:
                self.prefix = self.decode_one_now(ids[k : self.prefix_index])
                self.prefix_index -= k
                del ids[:k]
                return


def _emission_point(
    ends: list[int], raw: bytes, complete: int, low: int, k: int, floor: int
) -> int | None:
    """The last position in (low, k] where per-token pushing emits, for `_push_spm`'s case.

    Position k (k ids pushed) ends at byte `ends[k - 1]`. Per-token pushing emits there iff
    the text is clean, i.e. the offset is a character boundary within the `complete` bytes,
    and it grew beyond `floor` (the last emission's offset). Zero-byte ids (skipped specials)
    repeat an offset: the emission happened at the first position reaching it.
    """
    size = len(raw)
    while k > low:
        offset = ends[k - 1]
        if offset <= floor:
            return None
        if offset <= complete and (offset == size or raw[offset] & 0xC0 != 0x80):
            while k - 1 > low and ends[k - 2] == offset:
                k -= 1
            return k
        k -= 1
    return None
