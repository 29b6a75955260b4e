"""Incremental detokenization of one request: vLLM's Rust `DecodeStream` (after PR #44682), chunked.

The algorithm (spec §2, §9) keeps a short window of ids. `prefix` is the decode of the window's
first `prefix_index` ids, i.e. text already handed out. Pushing ids decodes `window + ids`; the
part beyond `prefix` (compared in UTF-8 bytes, like Rust) is emitted unless the text ends with
U+FFFD, which means "an unfinished character, wait". After an emission the window keeps only the
ids of that emission as left context, so it stays small: context plus ids since the last emission.

Differences from upstream, all deliberate:
- ids arrive in chunks. One decode per chunk gives exactly the per-token text (spec §9.6), with
  finer steps only where a chunk ends inside a character (probes) or, for ByteFallback decoders
  whose output is not append-monotonic, where the decode holds a U+FFFD (per-token steps).
- A prompt that ends mid-character does not leak the prompt (spec §2.10, `fix_prompt_tail`).
- Python `tokenizers` silently drops unknown ids, so strictness (generated unknown ids raise) is
  enforced here with a known-id table.

The general push logic is a generator that yields the id sequences it needs decoded and receives
their texts. `push` answers at once; `pipeline.batch.decode_round` collects the requests of many
streams and answers them with one `decode_batch` per tokenizer and flag. Streams whose tokenizer
has a pure Python decoder (`pipeline.vocab_tables`) decode inline and never yield, and `push`
first tries a fast path that decides a whole chunk in byte arithmetic on the decoder's table:
- top-level ByteLevel: a settled window of pending ids only (`_settle`), one join + one lossy
  decode per chunk (`push`, `_hold_bytes`);
- the Llama-2 ByteFallback chain: the per-token emission points computed from byte offsets
  (`_push_spm`, `_emission_point`).
Anything a fast path cannot decide exactly (unknown or malformed ids, invalid byte runs, a literal
U+FFFD, an unclean prefix) falls through to the general logic, which is the reference.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Callable, Generator, Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Any, Literal

from tokenizers import Tokenizer

from pipeline.vocab_tables import FFFD, TokenizerProfile, profile_for

U32 = 1 << 32

# Seeding tries prompt suffixes of SAFE_SUFFIX_MIN..=SAFE_SUFFIX_MAX ids, shortest first (upstream
# constants). 4 ids cover a CJK glyph straddling 1-2 token boundaries; beyond 6 the full-prompt
# fallback is no worse, so a wider sweep only adds decodes.
SAFE_SUFFIX_MIN = 4
SAFE_SUFFIX_MAX = 6

# When the whole prompt decodes to text ending in U+FFFD, the prefix is the longest prompt head
# that does not. A character has at most 4 bytes, so 1-3 probes normally suffice; the bound only
# stops adversarial tails (long runs of invalid bytes or skipped specials) from costing one
# full-prompt decode per id. Past it the full prompt text is the prefix: the prompt still never
# leaks, but a character straddling into the generation may come out as U+FFFD.
PROMPT_TAIL_PROBES = 32

SNAPSHOT_VERSION = 1

UnknownPolicy = Literal["error", "skip"]
# What the push generator yields: sequences to decode; it is sent their texts, in the same order.
DecodeRequest = list[list[int]]
PushSteps = Generator[DecodeRequest, list[str], str]


class InvalidTokenIdError(ValueError):
    """A token id that is not an integer in [0, 2**32): malformed input, rejected up front."""


class StrictDecodeError(Exception):
    """A generated id the tokenizer cannot map (spec §2.1, #44682: generated ids stay strict).

    `partial_text` is the text produced by the ids before it in the same chunk; the stream state
    reflects those ids as pushed, exactly as if they had been pushed one by one before the error.
    """

    def __init__(self, token_id: int, partial_text: str) -> None:
        super().__init__(f"cannot decode unknown token id {token_id}")
        self.token_id = token_id
        self.partial_text = partial_text


def utf8_len(text: str) -> int:
    """Length in UTF-8 bytes: the unit upstream compares lengths in."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def slice_from_byte(text: str, n: int) -> str:
    """`text[n..]` in UTF-8 bytes, with n floored to a char boundary (Rust `floor_char_boundary`).

    Flooring instead of failing is what upstream does for non-monotonic decodes (vllm #17448).
    """
    if text.isascii():
        return text[n:]
    raw = text.encode("utf-8")
    if n >= len(raw):
        return ""
    while n > 0 and (raw[n] & 0xC0) == 0x80:
        n -= 1
    return raw[n:].decode("utf-8")


def validated_ids(token_ids: Sequence[Any]) -> list[int]:
    """The ids as a list of ints, or InvalidTokenIdError naming the first bad one.

    `tokenizers` would raise OverflowError/TypeError on these, deep inside a decode; here the
    whole sequence is checked first, so a malformed chunk changes no state.
    """
    ids = list(token_ids)
    try:
        # C-speed check: array('I') takes exactly the ints in [0, 2**32) (and rejects the rest
        # with OverflowError/TypeError), so prompts of thousands of ids cost no Python loop. The
        # ids themselves are kept (`tolist` would allocate a new int object per id); `snapshot`
        # normalizes int-likes such as numpy integers to plain ints.
        array("I", ids)
        return ids
    except (OverflowError, TypeError, ValueError):
        pass
    out: list[int] = []
    for position, raw in enumerate(ids):
        try:
            value = operator.index(raw)
        except TypeError:
            raise InvalidTokenIdError(
                f"token id at position {position} is not an integer: {raw!r}"
            ) from None
        if not 0 <= value < U32:
            raise InvalidTokenIdError(
                f"token id at position {position} is outside [0, 2**32): {value}"
            )
        out.append(value)
    return out


class DecodeStream:
    """Per-request incremental decoder: `push` chunks of generated ids, `flush` at finish.

    State (all of it; see `snapshot`):
    - `ids`: the window. Before seeding, the whole prompt; after, context + ids since the last
      emission. For ByteLevel the context is dropped whenever it ends cleanly (`_settle`), so a
      settled window is just the pending ids; for the Llama-2 chain the context is exactly the
      ids of the last per-token emission (usually 1-4 ids).
    - `prefix`: decode of `ids[:prefix_index]`, text already accounted for.
    - `prefix_index`: number of window ids covered by `prefix`.
    - `prefix_seeded`: the prompt has been turned into context (runs at most once; upstream's flag
      that replaced `prefix.is_empty()`, so a later empty prefix never re-seeds).
    - `filtered_prompt_ids`: prompt ids the tokenizer cannot map, dropped while seeding.
    """

    __slots__ = (
        "tokenizer",
        "skip_special_tokens",
        "unknown_generated_ids",
        "ids",
        "prefix",
        "prefix_index",
        "prefix_seeded",
        "filtered_prompt_ids",
        "_profile",
        "_known",
        "_pure_decode",
        "_byte_table",
        "_spm_table",
        "decodes_inline",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        unknown_generated_ids: UnknownPolicy = "error",
    ) -> None:
        if unknown_generated_ids not in ("error", "skip"):
            raise ValueError(
                f"unknown_generated_ids must be 'error' or 'skip', not {unknown_generated_ids!r}"
            )
        self.tokenizer = tokenizer
        self.skip_special_tokens = bool(skip_special_tokens)
        self.unknown_generated_ids: UnknownPolicy = unknown_generated_ids
        self.ids = validated_ids(prompt_token_ids)
        self.prefix = ""
        self.prefix_index = 0
        self.prefix_seeded = not self.ids
        self.filtered_prompt_ids: list[int] = []
        self._profile: TokenizerProfile = profile_for(tokenizer)
        self._known = self._profile.known
        self._pure_decode: Callable[[Sequence[int]], str] | None = self._profile.pure_decode.get(
            self.skip_special_tokens
        )
        # id -> token bytes (None = unknown) for top-level ByteLevel decoders, else None.
        self._byte_table: list[bytes | None] | None = self._profile.byte_table.get(
            self.skip_special_tokens
        )
        # id -> piece bytes (None = unknown) for the Llama-2 ByteFallback chain, else None.
        self._spm_table: list[bytes | None] | None = self._profile.spm_table.get(
            self.skip_special_tokens
        )
        # True when `push` never needs `tokenizers` (pure decoder): `decode_round` then calls
        # `push` directly instead of driving `push_steps`.
        self.decodes_inline = self._pure_decode is not None

    # ----------------------------------------------------------------- public API

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode one chunk of generated ids; return the new text ("" if none is ready)."""
        chunk = token_ids if type(token_ids) is list else list(token_ids)
        table = self._byte_table
        if table is not None and chunk:
            # ByteLevel fast path. Validation rides on the table lookup: unknown ids (None) and
            # non-ints raise TypeError, ids past the table IndexError; negative ids would index
            # from the end, hence `min`. Any of those takes the general path, which validates and
            # reports exactly (and, like here, changes no state before validating).
            # (`itemgetter` fetches a chunk faster than `map(table.__getitem__, ...)`, but
            # returns a bare item, not a tuple, for a single id.)
            try:
                if min(chunk) < 0:
                    raw = None
                elif len(chunk) > 1:
                    raw = b"".join(itemgetter(*chunk)(table))
                else:
                    raw = table[chunk[0]]
            except (TypeError, IndexError):
                raw = None
            if raw is not None:
                if not self.prefix_seeded:
                    # A pure decoder never yields: one `next` runs the whole seeding.
                    next(self._seed(), None)
                    self.prefix_seeded = True
                if not self.prefix_index:
                    # Settled state (see `_settle`): the window is only the ids pending since the
                    # last emission, and per-token pushing emits the lossy UTF-8 of their bytes as
                    # soon as it does not end in U+FFFD. One join and one decode decide the chunk.
                    pending = self.ids
                    if pending:
                        raw = b"".join(map(table.__getitem__, pending)) + raw
                    text = raw.decode("utf-8", "replace")
                    if not text.endswith(FFFD):
                        if pending:
                            self.ids = []
                        return text
                    return self._hold_bytes(table, chunk, raw)
        elif self._spm_table is not None and chunk:
            text = self._push_spm(self._spm_table, chunk)
            if text is not None:
                return text
        steps = self.push_steps(chunk)
        try:
            request = next(steps)
            while True:
                request = steps.send(self.decode_now(request))
        except StopIteration as done:
            return done.value

    def flush(self) -> str:
        """At finish: the dangling tail (an unfinished character comes out as U+FFFD, as upstream).

        A stream that was never pushed a token returns "" and decodes nothing: the prompt is
        never emitted (upstream #47707).
        """
        tail = ""
        if self.prefix_seeded and self.ids:
            text = self._decode_one_now(self.ids)
            tail = slice_from_byte(text, utf8_len(self.prefix))
        self.ids = []
        self.prefix = ""
        self.prefix_index = 0
        self.prefix_seeded = True
        return tail

    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-able plain values (for a changelog); see `from_snapshot`."""
        return {
            "version": SNAPSHOT_VERSION,
            "skip_special_tokens": self.skip_special_tokens,
            "unknown_generated_ids": self.unknown_generated_ids,
            "ids": array("I", self.ids).tolist(),
            "prefix": self.prefix,
            "prefix_index": self.prefix_index,
            "prefix_seeded": self.prefix_seeded,
            "filtered_prompt_ids": array("I", self.filtered_prompt_ids).tolist(),
        }

    @classmethod
    def from_snapshot(cls, tokenizer: Tokenizer, snapshot: dict[str, Any]) -> DecodeStream:
        """Rebuild a stream that continues with exactly the output the original would produce."""
        if snapshot.get("version") != SNAPSHOT_VERSION:
            raise ValueError(
                f"unsupported DecodeStream snapshot version: {snapshot.get('version')!r}"
            )
        stream = cls(
            tokenizer,
            [],
            skip_special_tokens=snapshot["skip_special_tokens"],
            unknown_generated_ids=snapshot["unknown_generated_ids"],
        )
        stream.ids = validated_ids(snapshot["ids"])
        stream.prefix = str(snapshot["prefix"])
        stream.prefix_index = int(snapshot["prefix_index"])
        stream.prefix_seeded = bool(snapshot["prefix_seeded"])
        stream.filtered_prompt_ids = validated_ids(snapshot["filtered_prompt_ids"])
        if not 0 <= stream.prefix_index <= len(stream.ids):
            raise ValueError("snapshot prefix_index is outside its window")
        return stream

    # ----------------------------------------------------------------- decoding plumbing

    def decode_now(self, sequences: DecodeRequest) -> list[str]:
        """Answer a decode request of this stream directly (the single-stream driver)."""
        if len(sequences) == 1:
            return [self._decode_one_now(sequences[0])]
        return self.tokenizer.decode_batch(sequences, skip_special_tokens=self.skip_special_tokens)

    def _decode_one_now(self, ids: Sequence[int]) -> str:
        if self._pure_decode is not None:
            return self._pure_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode(self, sequences: DecodeRequest) -> Generator[DecodeRequest, list[str], list[str]]:
        """Decode inline with a pure decoder, else yield the request to the driver."""
        if self._pure_decode is not None:
            return [self._pure_decode(s) for s in sequences]
        return (yield sequences)

    # ----------------------------------------------------------------- the algorithm

    def push_steps(self, token_ids: Sequence[int]) -> PushSteps:
        """`push` as a generator of decode requests (see the module docstring)."""
        chunk, first_unknown = self._checked_chunk(token_ids)
        if not chunk:
            return ""
        if not self.prefix_seeded:
            # Lazy, as upstream: a request that never generates a token never decodes its prompt.
            yield from self._seed()
            self.prefix_seeded = True
        if first_unknown < 0:
            return (yield from self._push_known(chunk))
        if self.unknown_generated_ids == "skip":
            # An unknown id decodes to nothing, so per-token pushing would never emit on it;
            # leaving it out of the window gives the same text (upstream #55240: zero-width).
            known = self._known
            chunk = [t for t in chunk if t < len(known) and known[t]]
            return (yield from self._push_known(chunk)) if chunk else ""
        # Per-token semantics: the ids before the unknown one are pushed first, then it fails.
        before = chunk[:first_unknown]
        partial = (yield from self._push_known(before)) if before else ""
        raise StrictDecodeError(chunk[first_unknown], partial)

    def _checked_chunk(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The chunk as a list of ints and the index of its first unknown id (-1 if none)."""
        chunk = token_ids if type(token_ids) is list else list(token_ids)
        known = self._known
        try:
            # Fast path, no Python loop: ints >= 0 that index a set byte of the table.
            if not chunk or (min(chunk) >= 0 and all(map(known.__getitem__, chunk))):
                return chunk, -1
        except (TypeError, IndexError):
            pass
        chunk = validated_ids(chunk)
        size = len(known)
        for position, t in enumerate(chunk):
            if t >= size or not known[t]:
                return chunk, position
        return chunk, -1

    def _seed(self) -> Generator[DecodeRequest, list[str], None]:
        """Turn the prompt into left context, exactly as upstream `seed_prefix` (spec §2.6, §9.4).

        Unknown prompt ids are dropped here (and only here) and recorded. Upstream decodes first
        and filters only when decode fails; `tokenizers` drops unknown ids itself, so decoding the
        filtered ids gives the same text.
        """
        prompt = self.ids
        n = len(prompt)
        known = self._known
        size = len(known)
        if n > SAFE_SUFFIX_MIN and self._pure_decode is not None:
            # Pure decoder: decodes are cheap table work, so stop at the first accepted suffix
            # (almost always the shortest one).
            decode = self._pure_decode
            for length in range(SAFE_SUFFIX_MIN, min(SAFE_SUFFIX_MAX, n - 1) + 1):
                suffix = prompt[n - length :]
                context = [t for t in suffix if t < size and known[t]]
                if len(context) >= SAFE_SUFFIX_MIN:
                    text = decode(context)
                    if FFFD not in text:
                        self._set_seed(suffix, context, text, len(context))
                        return
        elif n > SAFE_SUFFIX_MIN:
            # All candidate suffixes in one request (they are tiny), then the shortest accepted.
            suffixes = [
                prompt[n - length :]
                for length in range(SAFE_SUFFIX_MIN, min(SAFE_SUFFIX_MAX, n - 1) + 1)
            ]
            contexts = [[t for t in s if t < size and known[t]] for s in suffixes]
            texts = yield from self._decode(contexts)
            for suffix, context, text in zip(suffixes, contexts, texts, strict=True):
                if FFFD not in text and len(context) >= SAFE_SUFFIX_MIN:
                    self._set_seed(suffix, context, text, len(context))
                    return
        context = [t for t in prompt if t < size and known[t]]
        (text,) = yield from self._decode([context])
        if not text.endswith(FFFD):
            self._set_seed(prompt, context, text, len(context))
            return
        # Deviation from upstream (spec §2.10): upstream leaves the prefix empty here, so the first
        # emission repeats the whole prompt. Instead the prefix is the longest clean prompt head;
        # the ids after it stay in the window, so the straddling character is emitted once, whole.
        for head_len in range(len(context) - 1, max(-1, len(context) - 1 - PROMPT_TAIL_PROBES), -1):
            (head,) = yield from self._decode([context[:head_len]])
            if not head.endswith(FFFD):
                self._set_seed(prompt, context, head, head_len)
                return
        self._set_seed(prompt, context, text, len(context))

    def _set_seed(
        self, source: list[int], context: list[int], prefix: str, prefix_index: int
    ) -> None:
        known = self._known
        size = len(known)
        self.filtered_prompt_ids = [t for t in source if not (t < size and known[t])]
        self.ids = context
        self.prefix = prefix
        self.prefix_index = prefix_index
        self._settle()

    def _settle(self) -> None:
        """For ByteLevel, drop the left context once the prefix ends on a clean boundary.

        Lossy UTF-8 is context free after a complete character: if `prefix` (= decode of
        `ids[:prefix_index]`) does not end in U+FFFD, decode(ids + more) is `prefix` followed by
        the decode of `ids[prefix_index:] + more`, so the context changes no future decision and
        the stream is equivalent to window = the pending ids, prefix = "", prefix_index = 0. That
        settled state is what `push`'s fast path runs on, and it keeps snapshots minimal.
        (A prefix ending in a literal U+FFFD is conservatively treated as unclean.)
        """
        if self._byte_table is not None and not self.prefix.endswith(FFFD):
            del self.ids[: self.prefix_index]
            self.prefix = ""
            self.prefix_index = 0

    def _hold_bytes(self, table: list[bytes | None], chunk: list[int], raw: bytes) -> str:
        """The settled ByteLevel push of a chunk whose text ends in U+FFFD (ends mid-character).

        `raw` is the bytes of pending ids + chunk. Per-token pushing emits, by the chunk's end,
        the text of the last k whose bytes decode non-empty and without a trailing U+FFFD; the
        ids from k on stay pending. Usually k = len(chunk) - 1 (one token into a character).
        """
        end = len(raw)
        for k in range(len(chunk) - 1, 0, -1):
            end -= len(table[chunk[k]])  # type: ignore[arg-type]  # known ids: bytes, not None
            text = raw[:end].decode("utf-8", "replace")
            if text and not text.endswith(FFFD):
                self.ids = chunk[k:]
                return text
        self.ids = self.ids + chunk
        return ""

    def _push_spm(self, table: list[bytes | None], chunk: list[int]) -> str | None:
        """The Llama-2 chain's push in byte arithmetic, or None to take the general path.

        While the bytes of window + chunk are valid UTF-8 (possibly missing the end of a last
        character) and hold no literal U+FFFD, the chain is the strict decode of the pieces'
        concatenation with one leading space stripped, and it is append-monotonic. Then
        per-token pushing emits exactly at the *emission points*: positions whose byte offset is
        a character boundary and beyond the last emission (see `_emission_point`). Its window
        after the chunk is the ids from the second-to-last emission point on, with `prefix` the
        decode of those up to the last one: this computes that state directly, with no probes.
        It needs the context text to be non-empty (so the Strip already happened there) and
        clean; invalid byte runs, literal U+FFFD and unknown ids take the general path.
        """
        try:
            if min(chunk) < 0:  # negative ids would index the table from the end
                return None
            # (`itemgetter` returns a bare item, not a tuple, for a single id.)
            fresh = itemgetter(*chunk)(table) if len(chunk) > 1 else (table[chunk[0]],)
            fresh_raw = b"".join(fresh)  # an unknown id (None) raises TypeError here
        except (TypeError, IndexError):  # not an int, past the table, or unknown
            return None
        if not self.prefix_seeded:
            # A pure decoder never yields: one `next` runs the whole seeding.
            next(self._seed(), None)
            self.prefix_seeded = True
        ids = self.ids
        prefix_index = self.prefix_index
        if not prefix_index or self.prefix.endswith(FFFD):
            return None
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

    def _push_known(self, chunk: list[int]) -> PushSteps:
        """Push ids that are all known; the text equals pushing them one at a time (spec §9.6).

        Per-token pushing emits, by the end of the chunk, `T(j) - prefix` for the last j whose
        decode `T(j) = decode(window + chunk[:j])` is longer than `prefix` and does not end in
        U+FFFD. Usually j is the whole chunk and one decode decides; only a chunk ending inside a
        character needs probes of shorter j.
        """
        ids = self.ids
        base = len(ids)
        ids.extend(chunk)
        (text,) = yield from self._decode([ids])
        if self._profile.has_byte_fallback and len(chunk) > 1 and FFFD in text:
            # ByteFallback turns a whole invalid run of byte tokens into U+FFFDs, so decoding is
            # not append-monotonic there and one decision per chunk could differ from per-token
            # pushing. Only chunks whose text holds a U+FFFD can be affected; step those per token.
            del ids[base:]
            parts = []
            for t in chunk:
                parts.append((yield from self._push_known([t])))
            return "".join(parts)
        prefix_len = utf8_len(self.prefix)
        if not text.endswith(FFFD):
            if utf8_len(text) > prefix_len:
                return (yield from self._emit_at(len(ids), text))
            return ""
        if len(chunk) == 1:
            return ""
        ends = range(base + len(chunk) - 1, base, -1)
        if self._pure_decode is not None:
            decode = self._pure_decode
            for end in ends:
                probe = decode(ids[:end])
                if not probe.endswith(FFFD) and utf8_len(probe) > prefix_len:
                    return (yield from self._emit_at(end, probe))
            return ""
        probes = yield from self._decode([ids[:end] for end in ends])
        for end, probe in zip(ends, probes, strict=True):
            if not probe.endswith(FFFD) and utf8_len(probe) > prefix_len:
                return (yield from self._emit_at(end, probe))
        return ""

    def _emit_at(self, end: int, text: str) -> PushSteps:
        """Emit `text` (= decode(ids[:end])) beyond the prefix; slide the window to `ids[old:]`."""
        new = slice_from_byte(text, utf8_len(self.prefix))
        old = self.prefix_index
        if self._profile.has_byte_fallback and self._ends_in_byte_run(end):
            old = yield from self._previous_emission(old, end, text)
        if self._profile.reuse_prefix and not self.prefix.endswith(FFFD):
            # Context-independent decoder and a clean split at `old`: decode(ids[old:end]) is
            # exactly the text just emitted, so the second decode is skipped.
            prefix = new
        else:
            (prefix,) = yield from self._decode([self.ids[old:end]])
        del self.ids[:old]
        self.prefix = prefix
        self.prefix_index = end - old
        self._settle()
        return new

    def _ends_in_byte_run(self, end: int) -> bool:
        """Whether the last *visible* id of `ids[:end]` is a `<0xNN>` byte token.

        Skipped specials vanish before the decoder runs, so a byte run continues across them:
        an emission ending "byte, skipped special" still ends inside a run.
        """
        ids = self.ids
        hidden = self._profile.special_ids if self.skip_special_tokens else frozenset()
        k = end - 1
        while k >= 0 and ids[k] in hidden:
            k -= 1
        return k >= 0 and bool(self._profile.byte_token[ids[k]])

    def _previous_emission(
        self, old: int, end: int, text: str
    ) -> Generator[DecodeRequest, list[str], int]:
        """Where per-token pushing would have emitted last before `end` (or `old` if nowhere).

        Per-token pushing keeps as context the ids of its *last single emission*; one decision
        per chunk keeps everything since the chunk's first. For ByteFallback the context matters
        when the emission ended inside a byte run: a later invalid byte extends that run back
        into the context, and the run's extent decides how many U+FFFD appear. So here the window
        is cut exactly where per-token pushing would cut it: the last k in (old, end) whose text
        is clean and strictly between the prefix and `text` in length (the chunk's decode holds
        no U+FFFD, so texts grow monotonically within it).
        """
        prefix_len = utf8_len(self.prefix)
        target = utf8_len(text)
        for k in range(end - 1, old, -1):
            (probe,) = yield from self._decode([self.ids[:k]])
            if probe.endswith(FFFD):
                continue
            length = utf8_len(probe)
            if length < target:
                return k if length > prefix_len else old
        return old


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
