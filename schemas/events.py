"""The wire format: every record detok reads or writes, as pydantic v2 models.

Inputs arrive on one topic keyed by request id, discriminated by `type`: a `prompt` (seq 0), then
`tokens` chunks (seq 1, 2, ...), then a `finish`. One topic for all three keeps a request's events
in partition order for free. Outputs are text deltas, one completion per request, filtered-id
records and dead letters. `detok run` reads logged generations, one JSON line per request.

Models are strict (no "5" -> 5 coercion): a producer that sends strings for ids has a bug we want
to see in the dead-letter topic, not paper over.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

# Token ids are u32 on every inference server and in `tokenizers`; anything else is rejected at
# the edge so that no OverflowError/TypeError can ever come out of the tokenizer.
MAX_TOKEN_ID = 2**32 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, Field(min_length=1, max_length=512)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]

# The prompt's full length when `prompt_token_ids` is only its tail (see README, 'Prompt tails').
PROMPT_TAIL_IDS = 64  # = pipeline.decode_state.PROMPT_CONTEXT_IDS (schemas import nothing else)
PROMPT_TOKENS_DESCRIPTION = (
    "The prompt's full length in ids when prompt_token_ids carries only its tail (absent: the "
    "ids are the whole prompt). At least len(prompt_token_ids). Decoding reads only the last "
    f"{PROMPT_TAIL_IDS} prompt ids, so a tail of min(prompt length, {PROMPT_TAIL_IDS}) ids gives "
    "output (text, filtered ids) identical to the whole prompt; completions report this count."
)
PromptTokens = Annotated[int | None, Field(ge=0, description=PROMPT_TOKENS_DESCRIPTION)]


class _PromptTail:
    """`prompt_tokens` counts the ids sent, so it is never below their number."""

    @model_validator(mode="after")
    def _prompt_tokens_covers_the_ids(self):  # type: ignore[no-untyped-def]
        count = self.prompt_tokens  # type: ignore[attr-defined]
        if count is not None and count < len(self.prompt_token_ids):  # type: ignore[attr-defined]
            raise ValueError("prompt_tokens is less than the number of prompt_token_ids")
        return self


class _Wire(BaseModel):
    # Unknown fields are ignored so producers can add fields before workers learn them.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class PromptEvent(_PromptTail, _Wire):
    """Opens a request: the prompt ids give the decoder its left context."""

    type: Literal["prompt"] = "prompt"
    request_id: RequestId
    model: ModelName
    seq: Literal[0] = 0
    prompt_token_ids: list[TokenId]
    skip_special_tokens: bool = True
    prompt_tokens: PromptTokens = None  # perfstate: prompt tails


class TokensEvent(_Wire):
    """A chunk of generated ids, in order: seq n follows seq n-1."""

    type: Literal["tokens"] = "tokens"
    request_id: RequestId
    seq: Annotated[int, Field(ge=1)]
    token_ids: list[TokenId]


class FinishEvent(_Wire):
    """Closes a request: the dangling tail is flushed and the completion published."""

    type: Literal["finish"] = "finish"
    request_id: RequestId
    seq: Annotated[int, Field(ge=1)]
    finish_reason: str | None = None


InputEvent = Annotated[PromptEvent | TokensEvent | FinishEvent, Field(discriminator="type")]
INPUT_EVENT_ADAPTER: TypeAdapter[PromptEvent | TokensEvent | FinishEvent] = TypeAdapter(InputEvent)


class TextDelta(_Wire):
    """New text of one request, covering input events seq_start..seq_end (inclusive).

    `text_offset` is the number of characters (Unicode code points) of the request's text before
    this delta. Under at-least-once, a replay after a crash may cut the seqs differently (deltas
    for 1..4 and then 1..14), so seq ranges can overlap; the text is a function of the ids, so a
    replayed delta agrees with the first on every character they share. A reader rebuilds the
    text by offset: of each delta it keeps the characters past those it already has, so a
    replay adds nothing twice and a longer one adds only its new tail.
    """

    type: Literal["delta"] = "delta"
    request_id: RequestId
    model: ModelName
    seq_start: Annotated[int, Field(ge=0)]
    seq_end: Annotated[int, Field(ge=0)]
    text_offset: Annotated[int, Field(ge=0)]
    text: str
    final: bool = False


class Completion(_Wire):
    """The whole generated text of one request, published once at finish (or failure)."""

    type: Literal["completion"] = "completion"
    request_id: RequestId
    model: ModelName
    text: str
    status: Literal["ok", "failed"]
    finish_reason: str | None = None
    prompt_tokens: Annotated[int, Field(ge=0)]
    generated_tokens: Annotated[int, Field(ge=0)]
    filtered_prompt_ids: list[TokenId] = []
    error: str | None = None


class FilteredIdsRecord(_Wire):
    """Emitted for every request whose prompt had ids the tokenizer cannot map.

    A record on the filtered-ids (`metrics`) topic, not a Prometheus metric: the name says so.
    """

    type: Literal["filtered_prompt_ids"] = "filtered_prompt_ids"
    request_id: RequestId
    model: ModelName
    filtered_ids: list[TokenId]
    filtered_count: Annotated[int, Field(ge=0)]
    prompt_tokens: Annotated[int, Field(ge=0)]


class DeadLetterReason(StrEnum):
    """Why a record went to the dead-letter topic: a bounded set, also a metric label."""

    MALFORMED_JSON = "malformed_json"
    SCHEMA_VIOLATION = "schema_violation"
    TOKEN_ID_OUT_OF_RANGE = "token_id_out_of_range"
    UNKNOWN_MODEL = "unknown_model"
    MISSING_PROMPT = "missing_prompt"
    EVENT_AFTER_FINISH = "event_after_finish"
    SEQUENCE_GAP = "sequence_gap"
    STRICT_DECODE_FAILURE = "strict_decode_failure"
    REQUEST_ALREADY_FAILED = "request_already_failed"
    TTL_EXPIRED = "ttl_expired"
    # Any exception while parsing or processing one record that no rule above names: the record
    # is set aside with the exception's class and message, and the stream goes on.
    UNEXPECTED_ERROR = "unexpected_error"
    # An output (completion, snapshot, dead letter) the broker would refuse as too large.
    OUTPUT_TOO_LARGE = "output_too_large"
    # A changelog record that cannot be turned back into request state (corrupt, an old format,
    # a model no longer configured): the request fails instead of the worker.
    RESTORE_FAILED = "restore_failed"
    # The record's Kafka key differs from the request id in its value.
    KEY_MISMATCH = "key_mismatch"
    # A request's events arrive on more than one input partition.
    PARTITION_MISMATCH = "partition_mismatch"


class DeadLetterRecord(_Wire):
    """A dead letter as `detok run` writes it to its dead-letter file (one JSON line)."""

    type: Literal["dead_letter"] = "dead_letter"
    reason: DeadLetterReason
    error_class: str
    error: str
    line: int | None = None
    request_id: str | None = None
    seq: int | None = None
    original: str


class LoggedGeneration(_PromptTail, _Wire):
    """One line of `detok run` / `detok replay` input: a whole logged generation."""

    request_id: RequestId
    model: ModelName
    prompt_token_ids: list[TokenId]
    output_token_ids: list[TokenId]
    skip_special_tokens: bool = True
    finish_reason: str | None = None
    prompt_tokens: PromptTokens = None  # perfstate: prompt tails


WIRE_MODELS: dict[str, type[BaseModel]] = {
    "prompt-event": PromptEvent,
    "tokens-event": TokensEvent,
    "finish-event": FinishEvent,
    "text-delta": TextDelta,
    "completion": Completion,
    "filtered-ids-metric": FilteredIdsRecord,
    "dead-letter-record": DeadLetterRecord,
    "logged-generation": LoggedGeneration,
}


# One msgspec encoder for every record detok writes itself (compact JSON, UTF-8 as is, the same
# bytes pydantic's `model_dump_json` writes for these plain values).
encode_json = msgspec.json.Encoder().encode


def dump_json(model: BaseModel) -> bytes:
    """`model.model_dump_json()`, ~5x faster: the worker writes one completion per request.

    A validated model holds exactly its fields, in declaration order, as plain JSON values (no
    aliases, no custom serializers in these models), so encoding them directly gives the same
    bytes; `tests/unit/test_schemas.py` holds the two encodings equal.
    """
    return encode_json(model.__dict__)
