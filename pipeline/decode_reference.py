"""The reference decode strategy: the general algorithm every decoder family can run.

It is vLLM's Rust `DecodeStream` (after PR #44682) taken a chunk at a time, on any decoder that
`tokenizers` runs (docs/decode-semantics.md). The window of ids is decoded with each chunk; the
part beyond `prefix` (compared in UTF-8 bytes) is emitted unless the text ends in U+FFFD (an
unfinished character: wait). After an emission the window keeps the ids of that emission as left
context, so it stays small.

The push logic is a generator that yields the id sequences it needs decoded and receives their
texts: `push` answers at once, and `pipeline.batch.decode_round` answers many streams' requests
with one `decode_batch` per tokenizer and flag. A profile with a pure Python decoder decodes
inline and never yields.

`ReferenceStream` is also the base of the two fast strategies (`pipeline.decode_byte_level`,
`pipeline.decode_spm`): they decide most chunks in byte arithmetic and fall back to this
algorithm for anything they cannot decide exactly. Two hooks let them keep the window bounded:
`_settle` (after seeding and after each emission: drop context that can no longer change any
output) and `_compact` (after a push that left text waiting: move final text out of the window
into `held`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, Self, TypeVar

from pipeline.decode_state import (
    DecodeRequest,
    PushSteps,
    StrictDecodeError,
    slice_from_byte,
    utf8_len,
    validated_ids,
)
from pipeline.decode_stream import DecodeStream
from pipeline.vocab_tables import FFFD, TokenizerProfile

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

Result = TypeVar("Result")


class ReferenceStream(DecodeStream):
    """The general algorithm; specialized per tokenizer and `skip_special_tokens` flag.

    `specialize` makes the subclass whose class attributes are that tokenizer's tables, so
    every stream of the tokenizer shares them and reads them like its own fields; the stream's
    per-request data are the `DecodeState` slots it inherits. Subclasses add their tables by
    extending `_class_attributes`, and their fast paths by overriding `push`.
    """

    __slots__ = ()

    profile: TokenizerProfile
    known: bytearray  # known[i] == 1 iff id i is known (ids past its end are unknown)
    pure_decode: Callable[[Sequence[int]], str] | None
    hidden: frozenset[int]  # ids that vanish before the decoder runs (skipped specials)

    @classmethod
    def specialize(cls, profile: TokenizerProfile, skip_special_tokens: bool) -> type[Self]:
        """The stream class of this strategy for one tokenizer profile and skip flag."""
        attributes = cls._class_attributes(profile, skip_special_tokens)
        return type(cls.__name__, (cls,), {"__slots__": (), **attributes})

    @classmethod
    def _class_attributes(cls, profile: TokenizerProfile, skip: bool) -> dict[str, Any]:
        pure_decode = profile.pure_decode.get(skip)
        return {
            "tokenizer": profile.tokenizer,
            "skip_special_tokens": skip,
            "profile": profile,
            "known": profile.known,
            # A plain function as a class attribute would bind as a method: keep it static.
            "pure_decode": None if pure_decode is None else staticmethod(pure_decode),
            "decodes_inline": pure_decode is not None,
            "hidden": profile.special_ids if skip else frozenset(),
        }

    # ----------------------------------------------------------------- the interface

    def seed(self) -> None:
        """Seed at once: the window then never holds more of the prompt than seeding keeps."""
        if self.decodes_inline:
            next(self._seed(), None)  # a pure decoder never yields: one step runs it all
        else:
            self._run(self._seed())

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode one chunk of generated ids; return the new text ("" if none is ready)."""
        return self._run(self.push_steps(token_ids))

    def push_steps(self, token_ids: Sequence[int]) -> PushSteps:
        """`push` as a generator of decode requests (see the module docstring)."""
        chunk, first_unknown = self._checked_chunk(token_ids)
        if not chunk:
            return ""
        self.started = True
        if first_unknown < 0:
            text = yield from self._push_known(chunk)
            self._compact()
            return text
        if self.unknown_generated_ids == "skip":
            # An unknown id decodes to nothing, so per-token pushing would never emit on it;
            # leaving it out of the window gives the same text (upstream #55240: zero-width).
            known = self.known
            chunk = [t for t in chunk if t < len(known) and known[t]]
            if not chunk:
                return ""
            text = yield from self._push_known(chunk)
            self._compact()
            return text
        # Per-token semantics: the ids before the unknown one are pushed first, then it fails.
        before = chunk[:first_unknown]
        partial = (yield from self._push_known(before)) if before else ""
        raise StrictDecodeError(chunk[first_unknown], partial)

    def flush(self) -> str:
        """At finish: the dangling tail (an unfinished character comes out as U+FFFD, as upstream).

        A stream that was never pushed a token returns "" and decodes nothing: the prompt is
        never emitted (upstream #47707).
        """
        tail = ""
        if self.started:
            if self.ids:
                text = self.decode_one_now(self.ids)
                tail = slice_from_byte(text, utf8_len(self.prefix))
            if self.held:  # (held before any push: prompt text, never emitted)
                tail = "".join(self.held) + tail
        self.ids = []
        self.prefix = ""
        self.prefix_index = 0
        self.started = True
        self.held = ()
        return tail

    # ----------------------------------------------------------------- decoding plumbing

    def _run(self, steps: Generator[DecodeRequest, list[str], Result]) -> Result:
        """Drive a step generator with direct decodes (the single-stream driver)."""
        try:
            request = next(steps)
            while True:
                request = steps.send(self.decode_now(request))
        except StopIteration as done:
            return done.value

    def decode_now(self, sequences: DecodeRequest) -> list[str]:
        """Answer a decode request directly."""
        if len(sequences) == 1:
            return [self.decode_one_now(sequences[0])]
        return self.tokenizer.decode_batch(sequences, skip_special_tokens=self.skip_special_tokens)

    def decode_one_now(self, ids: Sequence[int]) -> str:
        if self.pure_decode is not None:
            return self.pure_decode(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode(self, sequences: DecodeRequest) -> Generator[DecodeRequest, list[str], list[str]]:
        """Decode inline with a pure decoder, else yield the request to the driver."""
        if self.pure_decode is not None:
            return [self.pure_decode(s) for s in sequences]
        return (yield sequences)

    # ----------------------------------------------------------------- hooks

    def _settle(self) -> None:
        """After seeding or an emission: drop left context that no output depends on any more.

        The general algorithm cannot know that for an arbitrary decoder, so it keeps the window.
        """

    def _compact(self) -> None:
        """After a push: drop skipped special tokens the window waits behind.

        `tokenizers` removes them before any decoder runs, so they change no decode; without this
        a run of them behind an unfinished character would grow the window by one id each.
        """
        ids = self.ids
        start = self.prefix_index
        if len(ids) - start > SAFE_SUFFIX_MAX and self.hidden:
            hidden = self.hidden
            kept = [t for t in ids[start:] if t not in hidden]
            if len(kept) < len(ids) - start:
                del ids[start:]
                ids.extend(kept)

    # ----------------------------------------------------------------- the algorithm

    def _checked_chunk(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The chunk as a list of ints and the index of its first unknown id (-1 if none)."""
        chunk = token_ids if type(token_ids) is list else list(token_ids)
        known = self.known
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
        """Turn the prompt into left context, as upstream `seed_prefix`
        (docs/decode-semantics.md, 'Seeding').

        Unknown prompt ids are dropped here (and only here) and recorded. Upstream decodes first
        and filters only when decode fails; `tokenizers` drops unknown ids itself, so decoding the
        filtered ids gives the same text.
        """
        prompt = self.ids
        n = len(prompt)
        if not n:
            return
        known = self.known
        size = len(known)
        if n > SAFE_SUFFIX_MIN and self.pure_decode is not None:
            # Pure decoder: decodes are cheap table work, so stop at the first accepted suffix
            # (almost always the shortest one).
            decode = self.pure_decode
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
        # Deviation from upstream (docs/decode-semantics.md, 'A prompt ending mid-character'):
        # upstream leaves the prefix empty here, so the first emission repeats the whole prompt.
        # Instead the prefix is the longest clean prompt head; the ids after it stay in the
        # window, so the straddling character is emitted once, whole.
        for head_len in range(len(context) - 1, max(-1, len(context) - 1 - PROMPT_TAIL_PROBES), -1):
            (head,) = yield from self._decode([context[:head_len]])
            if not head.endswith(FFFD):
                self._set_seed(prompt, context, head, head_len)
                return
        self._set_seed(prompt, context, text, len(context))

    def _set_seed(
        self,
        source: list[int],
        context: list[int],
        prefix: str,
        prefix_index: int,
    ) -> None:
        known = self.known
        size = len(known)
        self.filtered_ids = [t for t in source if not (t < size and known[t])] or ()
        self.ids = context
        self.prefix = prefix
        self.prefix_index = prefix_index
        self._settle()

    def _push_known(self, chunk: list[int]) -> PushSteps:
        """Push ids that are all known; the text equals pushing them one at a time
        (docs/decode-semantics.md, 'Chunks').

        Per-token pushing emits, by the end of the chunk, `T(j) - prefix` for the last j whose
        decode `T(j) = decode(window + chunk[:j])` is longer than `prefix` and does not end in
        U+FFFD. Usually j is the whole chunk and one decode decides; only a chunk ending inside a
        character needs probes of shorter j.
        """
        ids = self.ids
        base = len(ids)
        ids.extend(chunk)
        (text,) = yield from self._decode([ids])
        if self.profile.has_byte_fallback and len(chunk) > 1 and FFFD in text:
            # ByteFallback turns a whole invalid run of byte tokens into U+FFFDs, so decoding is
            # not append-monotonic there and one decision per chunk could differ from per-token
            # pushing. Only chunks whose text holds a U+FFFD can be affected; step those per token
            # (compacting after each, so a long invalid run stays a short window).
            del ids[base:]
            parts = []
            for t in chunk:
                parts.append((yield from self._push_known([t])))
                self._compact()
            return "".join(parts)
        prefix_len = utf8_len(self.prefix)
        if not text.endswith(FFFD):
            if utf8_len(text) > prefix_len:
                return (yield from self._emit_at(len(ids), text))
            return ""
        if len(chunk) == 1:
            return ""
        ends = range(base + len(chunk) - 1, base, -1)
        if self.pure_decode is not None:
            decode = self.pure_decode
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
        if self.profile.has_byte_fallback and self._ends_in_byte_run(end):
            old = yield from self._previous_emission(old, end, text)
        if self.profile.reuse_prefix and not self.prefix.endswith(FFFD):
            # Context-independent decoder and a clean split at `old`: decode(ids[old:end]) is
            # exactly the text just emitted, so the second decode is skipped.
            prefix = new
        else:
            (prefix,) = yield from self._decode([self.ids[old:end]])
        del self.ids[:old]
        self.prefix = prefix
        self.prefix_index = end - old
        if self.held:
            new = "".join(self.held) + new
            self.held = ()
        self._settle()
        return new

    def _ends_in_byte_run(self, end: int) -> bool:
        """Whether the last *visible* id of `ids[:end]` is a `<0xNN>` byte token.

        Skipped specials vanish before the decoder runs, so a byte run continues across them:
        an emission ending "byte, skipped special" still ends inside a run.
        """
        ids = self.ids
        hidden = self.hidden
        k = end - 1
        while k >= 0 and ids[k] in hidden:
            k -= 1
        return k >= 0 and bool(self.profile.byte_token[ids[k]])

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
