"""The input events as the pipeline holds them: msgspec Structs, decoded in one C pass.

The pydantic models in `events.py` are the contract: the exported JSON Schema, the validation
messages of dead letters. Decoding every input record through them cost 4-7 us per record in the
worker, as much as the decode itself; these Structs mirror them field for field (same field
names, order, defaults and bounds) and decode the same bytes in 1-2 us. They are named `Parsed*`
so that code can never confuse them with the models (a `type(x) is PromptEvent` check against the
wrong class is silently always false). `validation.parse_event` decodes
here first and asks pydantic only about records these refuse, so a refusal still carries
pydantic's reason and message; `tests/unit/test_fast_events.py` checks on generated records that
both accept and refuse exactly the same inputs.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from schemas.events import MAX_TOKEN_ID, encode_json

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
GeneratedSeq = Annotated[int, msgspec.Meta(ge=1)]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Frozen like the models; `type` is the tag, written first like the models' first field."""


class ParsedPrompt(_Event, kw_only=True, tag="prompt"):
    """Opens a request: the prompt ids give the decoder its left context."""

    request_id: RequestId
    model: ModelName
    seq: Literal[0] = 0
    prompt_token_ids: list[TokenId]
    skip_special_tokens: bool = True
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None  # perfstate: prompt tails

    type = "prompt"

    def __post_init__(self) -> None:
        # As the model's validator (msgspec reports a ValueError here as a ValidationError).
        count = self.prompt_tokens
        if count is not None and count < len(self.prompt_token_ids):
            raise ValueError("prompt_tokens is less than the number of prompt_token_ids")


class ParsedTokens(_Event, kw_only=True, tag="tokens"):
    """A chunk of generated ids, in order: seq n follows seq n-1."""

    request_id: RequestId
    seq: GeneratedSeq
    token_ids: list[TokenId]

    type = "tokens"


class ParsedFinish(_Event, kw_only=True, tag="finish"):
    """Closes a request: the dangling tail is flushed and the completion published."""

    request_id: RequestId
    seq: GeneratedSeq
    finish_reason: str | None = None

    type = "finish"


ParsedEvent = ParsedPrompt | ParsedTokens | ParsedFinish

_DECODER = msgspec.json.Decoder(ParsedEvent)


def decode_event(raw: bytes | str) -> ParsedEvent:
    """One input record; raises `msgspec.DecodeError` (its `ValidationError` included)."""
    return _DECODER.decode(raw)


def encode_event(event: ParsedEvent) -> bytes:
    """The record a producer would send for this event (tag first, every field written)."""
    return encode_json(event)


def event_to_json(event: ParsedEvent) -> dict[str, Any]:
    """Plain JSON values, tag included (for snapshots of held events)."""
    return msgspec.to_builtins(event)


def event_from_json(data: Any) -> ParsedEvent:
    """The inverse of `event_to_json`, validated like a decoded record."""
    return msgspec.convert(data, ParsedEvent)
