"""Incremental detokenization of one request: the stream other modules use.

A `DecodeStream` is one request's `DecodeState` plus the decode strategy of its tokenizer,
picked once from the tokenizer profile's `kind` (docs/decode-semantics.md, 'Strategies'):

- `byte_level` -> `ByteLevelStrategy` (pipeline/decode_byte_level.py): byte arithmetic on the
  token table, GPT-2 / Qwen / Llama-3 / OLMo;
- `spm_byte_fallback` -> `SpmByteFallbackStrategy` (pipeline/decode_spm.py): the Llama-2
  SentencePiece chain in byte-offset arithmetic;
- anything else -> `ReferenceStrategy` (pipeline/decode_reference.py): the general algorithm
  through `tokenizers` (or a profile's pure decoder).

Every strategy shares the state and its snapshot format (pipeline/decode_state.py), and the two
fast ones fall back to the reference algorithm for anything they cannot decide exactly, so the
text never depends on which one runs: it is the per-token text of the rules in
docs/decode-semantics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from pipeline.decode_byte_level import ByteLevelStrategy
from pipeline.decode_reference import DecodeRequest, PushSteps, ReferenceStrategy
from pipeline.decode_spm import SpmByteFallbackStrategy
from pipeline.decode_state import (
    SNAPSHOT_VERSION,
    DecodeState,
    InvalidTokenIdError,
    SnapshotFormatError,
    StrictDecodeError,
    UnknownPolicy,
    needs_seeding,
    slice_from_byte,
    utf8_len,
    validated_ids,
)
from pipeline.vocab_tables import TokenizerProfile, profile_for

__all__ = [
    "SNAPSHOT_VERSION",
    "DecodeRequest",
    "DecodeStream",
    "InvalidTokenIdError",
    "PushSteps",
    "SnapshotFormatError",
    "StrictDecodeError",
    "UnknownPolicy",
    "slice_from_byte",
    "strategy_for",
    "utf8_len",
]

_STRATEGY_OF_KIND: dict[str, type[ReferenceStrategy]] = {
    "byte_level": ByteLevelStrategy,
    "spm_byte_fallback": SpmByteFallbackStrategy,
}


def strategy_for(profile: TokenizerProfile, skip_special_tokens: bool) -> ReferenceStrategy:
    """The (shared, cached) strategy of a tokenizer profile for one skip flag."""
    strategy = profile.strategies.get(skip_special_tokens)
    if strategy is None:
        kind = _STRATEGY_OF_KIND.get(profile.kind, ReferenceStrategy)
        strategy = profile.strategies.setdefault(
            skip_special_tokens, kind(profile, skip_special_tokens)
        )
    return strategy


class DecodeStream:
    """Per-request incremental decoder: `push` chunks of generated ids, `flush` at finish.

    The prompt is seeded at construction, so the stream never keeps more of it than seeding
    leaves as left context (usually 4-6 ids), and `snapshot()` stays small however long the
    prompt was. `state` is everything the stream remembers; the strategy is shared by every
    stream of the same tokenizer and flag.
    """

    __slots__ = ("tokenizer", "state", "decodes_inline", "_strategy")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        unknown_generated_ids: UnknownPolicy = "error",
    ) -> None:
        state = DecodeState(
            validated_ids(prompt_token_ids),
            skip_special_tokens=skip_special_tokens,
            unknown_generated_ids=unknown_generated_ids,
        )
        self._attach(tokenizer, state)
        self._strategy.seed(state)

    def _attach(self, tokenizer: Tokenizer, state: DecodeState) -> None:
        self.tokenizer = tokenizer
        self.state = state
        self._strategy = strategy_for(profile_for(tokenizer), state.skip_special_tokens)
        # True when `push` never needs `tokenizers` (pure decoder): `decode_round` then calls
        # `push` directly instead of driving `push_steps`.
        self.decodes_inline = self._strategy.decodes_inline

    @property
    def skip_special_tokens(self) -> bool:
        return self.state.skip_special_tokens

    @property
    def unknown_generated_ids(self) -> UnknownPolicy:
        return self.state.unknown_generated_ids

    @property
    def filtered_prompt_ids(self) -> list[int]:
        """Prompt ids the tokenizer cannot map, dropped while seeding (a metric).

        Reported once a token was pushed, as when seeding ran at the first push: a request that
        generates nothing never read its prompt, upstream, so it reports nothing.
        """
        return self.state.filtered_prompt_ids if self.state.started else []

    def push(self, token_ids: Sequence[int]) -> str:
        """Decode one chunk of generated ids; return the new text ("" if none is ready).

        Raises InvalidTokenIdError (malformed ids; no state changes) or StrictDecodeError (an
        unknown generated id under the "error" policy, with the text of the ids before it).
        """
        return self._strategy.push(self.state, token_ids)

    def push_steps(self, token_ids: Sequence[int]) -> PushSteps:
        """`push` as a generator of decode requests, for `pipeline.batch.decode_round`."""
        return self._strategy.push_steps(self.state, token_ids)

    def flush(self) -> str:
        """At finish: the dangling tail (an unfinished character comes out as U+FFFD).

        A stream that was never pushed a token returns "": the prompt is never emitted.
        """
        return self._strategy.flush(self.state)

    def snapshot(self) -> dict[str, Any]:
        """The whole state as JSON-able plain values (for a changelog); see `from_snapshot`."""
        return self.state.snapshot()

    @classmethod
    def from_snapshot(cls, tokenizer: Tokenizer, data: Any) -> DecodeStream:
        """Rebuild a stream that continues with exactly the output the original would produce.

        Raises SnapshotFormatError (a ValueError) for anything that is not a snapshot this
        module wrote: not an object, an unknown version, a missing or mistyped field, ids out of
        range, a prefix index outside the window.
        """
        state = DecodeState.from_snapshot(data)
        if needs_seeding(data):
            return cls(
                tokenizer,
                state.ids,
                skip_special_tokens=state.skip_special_tokens,
                unknown_generated_ids=state.unknown_generated_ids,
            )
        stream = cls.__new__(cls)
        stream._attach(tokenizer, state)
        return stream
