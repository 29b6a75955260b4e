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

from schemas.events import (
    MAX_PROMPT_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    check_aligned,
    encode_json,
)

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
GeneratedSeq = Annotated[int, msgspec.Meta(ge=1)]
PromptTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], msgspec.Meta(min_length=1, max_length=MAX_STOP_STRINGS)]
# msgspec's JSON decoder refuses NaN, Infinity and out-of-range numbers, as the models do.
TopLogprobPairs = Annotated[list[tuple[TokenId, float]], msgspec.Meta(max_length=MAX_TOP_LOGPROBS)]


class ParsedFunction(msgspec.Struct, frozen=True, kw_only=True):
    """`ToolFunction`: a function a request offers."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ParsedTool(msgspec.Struct, frozen=True, kw_only=True):
    """`Tool`: one entry of OpenAI's `tools` list."""

    type: Literal["function"] = "function"
    function: ParsedFunction


Tools = Annotated[list[ParsedTool], msgspec.Meta(min_length=1, max_length=MAX_TOOLS)]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Frozen like the models; `type` is the tag, written first like the models' first field."""


class ParsedPrompt(_Event, kw_only=True, tag="prompt"):
    """Opens a request: the prompt ids give the decoder its left context."""

    request_id: RequestId
    model: ModelName
    seq: Literal[0] = 0
    prompt_token_ids: list[TokenId]
    skip_special_tokens: bool = True
    stop: StopStrings | None = None
    include_stop_str_in_output: bool = False
    prompt_tokens: PromptTokens | None = None  # perfstate: prompt tails
    tools: Tools | None = None

    type = "prompt"

    def __post_init__(self) -> None:
        # As the model's validator (msgspec reports a ValueError here as a ValidationError).
        count = self.prompt_tokens
        if count is not None and count < len(self.prompt_token_ids):
            raise ValueError("prompt_tokens is less than the number of prompt_token_ids")


class ParsedTokens(_Event, kw_only=True, tag="tokens", omit_defaults=True):
    """A chunk of generated ids, in order: seq n follows seq n-1.

    Absent logprobs are not written (`omit_defaults`): tokens events are most of the input
    topic's records, and two nulls on each would cost every producer without the option.
    """

    request_id: RequestId
    seq: GeneratedSeq
    token_ids: list[TokenId]
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobPairs] | None = None

    type = "tokens"

    def __post_init__(self) -> None:
        # Two None checks when a chunk has no logprobs: the common case pays nothing more.
        if self.logprobs is not None or self.top_logprobs is not None:
            check_aligned(self.token_ids, self.logprobs, self.top_logprobs)


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
