"""Incremental detokenization of one request: the stream other modules use.

`DecodeStream(tokenizer, prompt_ids, ...)` builds the stream class of its tokenizer's decode
strategy, picked once per tokenizer and flag from the tokenizer profile's `kind`
(docs/decode-semantics.md, 'Strategies'), in the spirit of vLLM's one class per detokenizer:

- `byte_level` -> `ByteLevelStream` (pipeline/decode_byte_level.py): byte arithmetic on the token
  table, GPT-2 / Qwen / Llama-3 / OLMo;
- `spm_byte_fallback` -> `SpmByteFallbackStream` (pipeline/decode_spm.py): the Llama-2
  SentencePiece chain in byte-offset arithmetic;
- anything else -> `ReferenceStream` (pipeline/decode_reference.py): the general algorithm
  through `tokenizers` (or a profile's pure decoder).

Each is a subclass of `DecodeStream` (so of `DecodeState`: one state, one snapshot format),
specialized once per tokenizer and `skip_special_tokens` flag with that tokenizer's tables as
class attributes; a stream's fields are its own slots, so the per-chunk fast paths pay no
indirection. The two fast strategies fall back to the reference algorithm for anything they
cannot decide exactly, so the text never depends on which one runs: it is the per-token text of
the rules in docs/decode-semantics.md.

The interface every strategy implements (see `ReferenceStream`): `push(ids) -> str`,
`push_steps(ids)` (the same as a generator of decode requests, for `pipeline.batch`),
`flush() -> str`, `snapshot()`, and the class attributes `tokenizer`, `skip_special_tokens`,
`decodes_inline`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from pipeline.decode_state import (
    PROMPT_CONTEXT_IDS,
    SNAPSHOT_VERSION,
    DecodeRequest,
    DecodeState,
    InvalidTokenIdError,
    PushSteps,
    SnapshotFormatError,
    StrictDecodeError,
    UnknownPolicy,
    read_snapshot,
    slice_from_byte,
    utf8_len,
    validated_ids,
)
from pipeline.vocab_tables import PROFILES, profile_for

__all__ = [
    "PROMPT_CONTEXT_IDS",
    "SNAPSHOT_VERSION",
    "DecodeRequest",
    "DecodeStream",
    "InvalidTokenIdError",
    "PushSteps",
    "SnapshotFormatError",
    "StrictDecodeError",
    "UnknownPolicy",
    "slice_from_byte",
    "push_each",
    "stream_class_for",
    "utf8_len",
]


def stream_class_for(tokenizer: Tokenizer, skip_special_tokens: bool) -> type[DecodeStream]:
    """The stream class of a tokenizer and flag, built on first use and cached on its profile."""
    profile = profile_for(tokenizer)
    stream_class = profile.strategies.get(skip_special_tokens)
    if stream_class is None:
        # Imported here: the strategy modules subclass DecodeStream, defined below.
        from pipeline.decode_byte_level import ByteLevelStream
        from pipeline.decode_reference import ReferenceStream
        from pipeline.decode_spm import SpmByteFallbackStream

        base: type[ReferenceStream] = {
            "byte_level": ByteLevelStream,
            "spm_byte_fallback": SpmByteFallbackStream,
        }.get(profile.kind, ReferenceStream)
        stream_class = profile.strategies.setdefault(
            skip_special_tokens, base.specialize(profile, skip_special_tokens)
        )
    return stream_class


class DecodeStream(DecodeState):
    """Per-request incremental decoder: `push` chunks of generated ids, `flush` at finish.

    `push` raises InvalidTokenIdError (malformed ids; no state changes) or StrictDecodeError (an
    unknown generated id under the "error" policy, carrying the text of the ids before it).
    The prompt is seeded at construction from its last `PROMPT_CONTEXT_IDS` ids only, so the
    stream never keeps more of it than seeding leaves as left context (usually 4-6 ids) and
    `snapshot()` stays small however long the prompt was.
    """

    __slots__ = ()

    tokenizer: Tokenizer
    decodes_inline: bool  # `push` never needs `tokenizers`: `decode_round` calls it directly

    def __new__(
        cls,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        unknown_generated_ids: UnknownPolicy = "error",
    ) -> DecodeStream:
        if cls is DecodeStream:
            # The cached class without a call when it exists: one stream per request is built.
            profile = PROFILES.get(id(tokenizer))
            stream_class = None if profile is None else profile.strategies.get(skip_special_tokens)
            cls = stream_class or stream_class_for(tokenizer, bool(skip_special_tokens))
        return object.__new__(cls)

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        unknown_generated_ids: UnknownPolicy = "error",
    ) -> None:
        # Only the prompt's last PROMPT_CONTEXT_IDS ids are ever read (so only they are checked
        # and copied): the work and the state are bounded whatever the prompt's length.
        context = prompt_token_ids[-PROMPT_CONTEXT_IDS:]
        self._init_state(validated_ids(context), unknown_generated_ids)
        self.seed()

    @property
    def filtered_prompt_ids(self) -> list[int]:
        """Prompt ids the tokenizer cannot map, dropped while seeding (a metric).

        Reported once a token was pushed, as when seeding ran at the first push: a request that
        generates nothing never read its prompt, upstream, so it reports nothing.
        """
        filtered = self.filtered_ids
        return filtered if self.started and filtered else []  # a non-empty one is a list

    @classmethod
    def from_snapshot(cls, tokenizer: Tokenizer, data: Any) -> DecodeStream:
        """Rebuild a stream that continues with exactly the output the original would produce.

        Raises SnapshotFormatError (a ValueError) for anything that is not a snapshot this
        module wrote: not an object, an unknown version, a missing or mistyped field, ids out of
        range, a prefix index outside the window.
        """
        fields = read_snapshot(data)
        if fields.needs_seeding:
            return DecodeStream(
                tokenizer,
                fields.ids,
                skip_special_tokens=fields.skip_special_tokens,
                unknown_generated_ids=fields.unknown_generated_ids,
            )
        stream = object.__new__(stream_class_for(tokenizer, fields.skip_special_tokens))
        stream._restore_state(fields)
        return stream

    # The interface, implemented by `ReferenceStream` and its subclasses.

    def seed(self) -> None:
        """Turn the prompt in `ids` into left context (docs/decode-semantics.md, 'Seeding')."""
        raise NotImplementedError

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode one chunk of generated ids; return the new text ("" if none is ready)."""
        raise NotImplementedError

    def push_steps(self, token_ids: Sequence[int]) -> PushSteps:
        """`push` as a generator of decode requests, for `pipeline.batch.decode_round`."""
        raise NotImplementedError

    def flush(self) -> str:
        """At finish: the dangling tail (an unfinished character comes out as U+FFFD).

        A stream that was never pushed a token returns "": the prompt is never emitted.
        """
        raise NotImplementedError


def push_each(stream: DecodeStream, token_ids: Sequence[int], texts: list[str]) -> None:
    """Push `token_ids` one at a time, appending each id's own text to `texts`.

    Each text is what per-token pushing emits at that id (docs/decode-semantics.md, 'Pushing'),
    so, by chunk invariance, their concatenation is `push(token_ids)`: this is how text is
    attributed to tokens (a logprob entry's `text`, the token that completed a stop string).
    On an error `texts` holds the texts of the ids before the failing one.
    """
    push = stream.push
    append = texts.append
    for token_id in token_ids:
        append(push((token_id,)))
