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

`ReferenceStrategy` is also the base of the two fast strategies (`pipeline.decode_byte_level`,
`pipeline.decode_spm`): they decide most chunks in byte arithmetic and fall back to this
algorithm for anything they cannot decide exactly. Two hooks let them keep the window bounded:
`_settle` (after seeding and after each emission: drop context that can no longer change any
output) and `_compact` (after a push that left text waiting: move final text out of the window
into `held`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from tokenizers import Tokenizer

from pipeline.decode_state import (
    DecodeState,
    StrictDecodeError,
    slice_from_byte,
    utf8_len,
    validated_ids,
)
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

# What the push generator yields: sequences to decode; it is sent their texts, in the same order.
DecodeRequest = list[list[int]]
PushSteps = Generator[DecodeRequest, list[str], str]


class ReferenceStrategy:
    """The general algorithm, for one tokenizer and one `skip_special_tokens` flag.

    The strategy interface (what `DecodeStream` and `decode_round` call), shared by every
    strategy; all per-request data lives in the `DecodeState` passed in:
    - `seed(state)`: turn the prompt in `state.ids` into left context (at construction);
    - `push(state, ids) -> str`: decode one chunk of generated ids, answering decodes at once;
    - `push_steps(state, ids)`: the same as a generator of decode requests (batched driving);
    - `flush(state) -> str`: the dangling tail at finish;
    - `decodes_inline`: `push` never needs `tokenizers`, so batching it gains nothing.
    """

    def __init__(self, profile: TokenizerProfile, skip_special_tokens: bool) -> None:
        self.tokenizer: Tokenizer = profile.tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.profile = profile
        self.known = profile.known
        self.pure_decode: Callable[[Sequence[int]], str] | None = profile.pure_decode.get(
            skip_special_tokens
        )
        self.decodes_inline = self.pure_decode is not None
        self.hidden = profile.special_ids if skip_special_tokens else frozenset()

    # ----------------------------------------------------------------- the interface

    def seed(self, state: DecodeState) -> None:
        """Seed at once: the window then never holds more of the prompt than seeding keeps."""
        self._run(self._seed(state))

    def push(self, state: DecodeState, token_ids: Sequence[int]) -> str:
        """Decode one chunk of generated ids; return the new text ("" if none is ready)."""
        return self._run(self.push_steps(state, token_ids))

    def push_steps(self, state: DecodeState, token_ids: Sequence[int]) -> PushSteps:
        """`push` as a generator of decode requests (see the module docstring)."""
        chunk, first_unknown = self._checked_chunk(token_ids)
        if not chunk:
            return ""
        state.started = True
        if first_unknown < 0:
            text = yield from self._push_known(state, chunk)
            self._compact(state)
            return text
        if state.unknown_generated_ids == "skip":
            # An unknown id decodes to nothing, so per-token pushing would never emit on it;
            # leaving it out of the window gives the same text (upstream #55240: zero-width).
            known = self.known
            chunk = [t for t in chunk if t < len(known) and known[t]]
            if not chunk:
                return ""
            text = yield from self._push_known(state, chunk)
            self._compact(state)
            return text
        # Per-token semantics: the ids before the unknown one are pushed first, then it fails.
        before = chunk[:first_unknown]
        partial = (yield from self._push_known(state, before)) if before else ""
        raise StrictDecodeError(chunk[first_unknown], partial)

    def flush(self, state: DecodeState) -> str:
        """At finish: the dangling tail (an unfinished character comes out as U+FFFD, as upstream).

        A stream that was never pushed a token returns "" and decodes nothing: the prompt is
        never emitted (upstream #47707).
        """
        tail = ""
        if state.started and state.ids:
            text = self.decode_one_now(state.ids)
            tail = slice_from_byte(text, utf8_len(state.prefix))
        if state.held:
            tail = "".join(state.held) + tail
        state.ids = []
        state.prefix = ""
        state.prefix_index = 0
        state.started = True
        state.held = []
        return tail

    # ----------------------------------------------------------------- decoding plumbing

    def _run(self, steps: Generator[DecodeRequest, list[str], object]) -> object:  # type: ignore[type-arg]
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

    def _settle(self, state: DecodeState) -> None:
        """After seeding or an emission: drop left context that no output depends on any more.

        The general algorithm cannot know that for an arbitrary decoder, so it keeps the window.
        """

    def _compact(self, state: DecodeState) -> None:
        """After a push: drop skipped special tokens the window waits behind.

        `tokenizers` removes them before any decoder runs, so they change no decode; without this
        a run of them behind an unfinished character would grow the window by one id each.
        """
        ids = state.ids
        start = state.prefix_index
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

    def _seed(self, state: DecodeState) -> Generator[DecodeRequest, list[str], None]:
        """Turn the prompt into left context, as upstream `seed_prefix`
        (docs/decode-semantics.md, 'Seeding').

        Unknown prompt ids are dropped here (and only here) and recorded. Upstream decodes first
        and filters only when decode fails; `tokenizers` drops unknown ids itself, so decoding the
        filtered ids gives the same text.
        """
        prompt = state.ids
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
                        self._set_seed(state, suffix, context, text, len(context))
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
                    self._set_seed(state, suffix, context, text, len(context))
                    return
        context = [t for t in prompt if t < size and known[t]]
        (text,) = yield from self._decode([context])
        if not text.endswith(FFFD):
            self._set_seed(state, prompt, context, text, len(context))
            return
        # Deviation from upstream (docs/decode-semantics.md, 'A prompt ending mid-character'):
        # upstream leaves the prefix empty here, so the first emission repeats the whole prompt.
        # Instead the prefix is the longest clean prompt head; the ids after it stay in the
        # window, so the straddling character is emitted once, whole.
        for head_len in range(len(context) - 1, max(-1, len(context) - 1 - PROMPT_TAIL_PROBES), -1):
            (head,) = yield from self._decode([context[:head_len]])
            if not head.endswith(FFFD):
                self._set_seed(state, prompt, context, head, head_len)
                return
        self._set_seed(state, prompt, context, text, len(context))

    def _set_seed(
        self,
        state: DecodeState,
        source: list[int],
        context: list[int],
        prefix: str,
        prefix_index: int,
    ) -> None:
        known = self.known
        size = len(known)
        state.filtered_prompt_ids = [t for t in source if not (t < size and known[t])]
        state.ids = context
        state.prefix = prefix
        state.prefix_index = prefix_index
        self._settle(state)

    def _push_known(self, state: DecodeState, chunk: list[int]) -> PushSteps:
        """Push ids that are all known; the text equals pushing them one at a time
        (docs/decode-semantics.md, 'Chunks').

        Per-token pushing emits, by the end of the chunk, `T(j) - prefix` for the last j whose
        decode `T(j) = decode(window + chunk[:j])` is longer than `prefix` and does not end in
        U+FFFD. Usually j is the whole chunk and one decode decides; only a chunk ending inside a
        character needs probes of shorter j.
        """
        ids = state.ids
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
                parts.append((yield from self._push_known(state, [t])))
                self._compact(state)
            return "".join(parts)
        prefix_len = utf8_len(state.prefix)
        if not text.endswith(FFFD):
            if utf8_len(text) > prefix_len:
                return (yield from self._emit_at(state, len(ids), text))
            return ""
        if len(chunk) == 1:
            return ""
        ends = range(base + len(chunk) - 1, base, -1)
        if self.pure_decode is not None:
            decode = self.pure_decode
            for end in ends:
                probe = decode(ids[:end])
                if not probe.endswith(FFFD) and utf8_len(probe) > prefix_len:
                    return (yield from self._emit_at(state, end, probe))
            return ""
        probes = yield from self._decode([ids[:end] for end in ends])
        for end, probe in zip(ends, probes, strict=True):
            if not probe.endswith(FFFD) and utf8_len(probe) > prefix_len:
                return (yield from self._emit_at(state, end, probe))
        return ""

    def _emit_at(self, state: DecodeState, end: int, text: str) -> PushSteps:
        """Emit `text` (= decode(ids[:end])) beyond the prefix; slide the window to `ids[old:]`."""
        new = slice_from_byte(text, utf8_len(state.prefix))
        old = state.prefix_index
        if self.profile.has_byte_fallback and self._ends_in_byte_run(state, end):
            old = yield from self._previous_emission(state, old, end, text)
        if self.profile.reuse_prefix and not state.prefix.endswith(FFFD):
            # Context-independent decoder and a clean split at `old`: decode(ids[old:end]) is
            # exactly the text just emitted, so the second decode is skipped.
            prefix = new
        else:
            (prefix,) = yield from self._decode([state.ids[old:end]])
        del state.ids[:old]
        state.prefix = prefix
        state.prefix_index = end - old
        if state.held:
            new = "".join(state.held) + new
            state.held = []
        self._settle(state)
        return new

    def _ends_in_byte_run(self, state: DecodeState, end: int) -> bool:
        """Whether the last *visible* id of `ids[:end]` is a `<0xNN>` byte token.

        Skipped specials vanish before the decoder runs, so a byte run continues across them:
        an emission ending "byte, skipped special" still ends inside a run.
        """
        ids = state.ids
        hidden = self.hidden
        k = end - 1
        while k >= 0 and ids[k] in hidden:
            k -= 1
        return k >= 0 and bool(self.profile.byte_token[ids[k]])

    def _previous_emission(
        self, state: DecodeState, old: int, end: int, text: str
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
        prefix_len = utf8_len(state.prefix)
        target = utf8_len(text)
        for k in range(end - 1, old, -1):
            (probe,) = yield from self._decode([state.ids[:k]])
            if probe.endswith(FFFD):
                continue
            length = utf8_len(probe)
            if length < target:
                return k if length > prefix_len else old
        return old
