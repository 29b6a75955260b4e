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
from typing import Annotated, Any, Literal

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_serializer,
    model_serializer,
    model_validator,
)

# Token ids are u32 on every inference server and in `tokenizers`; anything else is rejected at
# the edge so that no OverflowError/TypeError can ever come out of the tokenizer.
MAX_TOKEN_ID = 2**32 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
RequestId = Annotated[str, Field(min_length=1, max_length=512)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]

# Decode options (docs/decode-options.md). The bounds keep one request's matching work and state
# small whatever a producer sends: 64 strings of 1,024 characters is more than any server allows
# (OpenAI: 4 strings), and a hold-back never exceeds the longest string.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
# OpenAI and vLLM's defaults cap top_logprobs at 20; each alternative is decoded into the output.
MAX_TOP_LOGPROBS = 20
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Field(min_length=1, max_length=MAX_STOP_STRINGS)]
# JSON has no infinities; a producer holding -inf must send a finite floor (vLLM sends -9999.0).
Logprob = Annotated[float, Field(allow_inf_nan=False)]
TopLogprobPairs = Annotated[list[tuple[TokenId, Logprob]], Field(max_length=MAX_TOP_LOGPROBS)]
Byte = Annotated[int, Field(ge=0, le=255)]


def check_aligned(
    ids: list[int], logprobs: list | None, top_logprobs: list | None, prefix: str = ""
) -> None:
    """Logprob lists carry one entry per id: a shorter or longer list cannot be attributed."""
    for name, values in ((f"{prefix}logprobs", logprobs), (f"{prefix}top_logprobs", top_logprobs)):
        if values is not None and len(values) != len(ids):
            raise ValueError(f"{name} has {len(values)} entries for {len(ids)} token ids")


# The prompt's full length when `prompt_token_ids` is only its tail (docs/production-shapes.md,
# 'Prompt tails').
PROMPT_TAIL_IDS = 64  # = pipeline.decode_state.PROMPT_CONTEXT_IDS (schemas import nothing else)
PROMPT_TOKENS_DESCRIPTION = (
    "The prompt's full length in ids when prompt_token_ids carries only its tail (absent: the "
    "ids are the whole prompt). At least len(prompt_token_ids). Decoding reads only the last "
    f"{PROMPT_TAIL_IDS} prompt ids, so a tail of min(prompt length, {PROMPT_TAIL_IDS}) ids gives "
    "output (text, filtered ids) identical to the whole prompt; completions report this count."
)
# A prompt's length is bounded by the sizes a model can have: the longest context windows are
# ~10M ids, 2**31 - 1 is 200x that and fits the int32/int64 columns consumers store counts in
# (an unbounded count passed validation and then broke Parquet output at 2**63, issue 32).
MAX_PROMPT_TOKENS = 2**31 - 1
PromptTokens = Annotated[
    int | None, Field(ge=0, le=MAX_PROMPT_TOKENS, description=PROMPT_TOKENS_DESCRIPTION)
]


# Tools a request offers (OpenAI's `tools` list). detok parses tool calls only for a request that
# offers tools, as vLLM does (docs/chat-outputs.md); it reads no more of them than that they are
# there, so the bounds only keep a record's state small: OpenAI allows 128 functions a request.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 256


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


class ToolFunction(_Wire):
    """A function a request offers: its name, and what OpenAI's request carries with it."""

    name: Annotated[str, Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Wire):
    """One entry of OpenAI's `tools` list."""

    type: Literal["function"] = "function"
    function: ToolFunction


Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)]


class PromptEvent(_PromptTail, _Wire):
    """Opens a request: the prompt ids give the decoder its left context."""

    type: Literal["prompt"] = "prompt"
    request_id: RequestId
    model: ModelName
    seq: Literal[0] = 0
    prompt_token_ids: list[TokenId]
    skip_special_tokens: bool = True
    stop: StopStrings | None = None
    include_stop_str_in_output: bool = False
    prompt_tokens: PromptTokens = None  # perfstate: prompt tails
    # The tools the request offers: its tool calls are parsed (docs/chat-outputs.md).
    tools: Tools | None = None


class TokensEvent(_Wire):
    """A chunk of generated ids, in order: seq n follows seq n-1."""

    type: Literal["tokens"] = "tokens"
    request_id: RequestId
    seq: Annotated[int, Field(ge=1)]
    token_ids: list[TokenId]
    logprobs: list[Logprob] | None = None
    top_logprobs: list[TopLogprobPairs] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> TokensEvent:
        check_aligned(self.token_ids, self.logprobs, self.top_logprobs)
        return self


class FinishEvent(_Wire):
    """Closes a request: the dangling tail is flushed and the completion published."""

    type: Literal["finish"] = "finish"
    request_id: RequestId
    seq: Annotated[int, Field(ge=1)]
    finish_reason: str | None = None


InputEvent = Annotated[PromptEvent | TokensEvent | FinishEvent, Field(discriminator="type")]
INPUT_EVENT_ADAPTER: TypeAdapter[PromptEvent | TokensEvent | FinishEvent] = TypeAdapter(InputEvent)


class TopLogprob(_Wire):
    """One alternative at a sampled position: its id, its string and bytes alone, its logprob."""

    id: TokenId
    token: str
    bytes: list[Byte]
    logprob: float


class TokenLogprob(_Wire):
    """One sampled token: `token`/`bytes` are the id alone (special tokens shown), `text` what
    it adds to the completion in context (empty while a character is incomplete), `text_offset`
    the characters of the completion before that text."""

    id: TokenId
    token: str
    bytes: list[Byte]
    text: str
    text_offset: Annotated[int, Field(ge=0)]
    logprob: float
    top_logprobs: list[TopLogprob]


class Logprobs(_Wire):
    """Per sampled token, in order (OpenAI's `choices[].logprobs.content` shape)."""

    # Read from the wire, `content` holds validated `TokenLogprob`s. Built by the pipeline, it
    # holds each entry's wire JSON instead (`msgspec.Raw`, see `pipeline.logprobs`): six models
    # a token (an entry and its alternatives) cost many times the token's decode, and the worker
    # only ever writes them out. `entries()` gives the models either way, and pydantic's dumps
    # write the same JSON for both. (A comment, not the docstring: that is the JSON Schema's.)
    content: list[TokenLogprob]

    def entries(self) -> list[TokenLogprob]:
        """The entries as models (validated from their JSON when the pipeline built them)."""
        if not self.content or not isinstance(self.content[0], msgspec.Raw):
            return self.content
        return _ENTRIES.validate_json(b"[" + b",".join(self.content) + b"]")  # type: ignore[arg-type]

    @field_serializer("content", mode="wrap")
    def _content(self, content: list, handler: SerializerFunctionWrapHandler) -> object:
        if content and isinstance(content[0], msgspec.Raw):
            return msgspec.json.decode(b"[" + b",".join(content) + b"]")
        return handler(content)


_ENTRIES: TypeAdapter[list[TokenLogprob]] = TypeAdapter(list[TokenLogprob])


class DeltaFunction(_Wire):
    """A tool call's function in a delta: its name on the call's first delta, then pieces of
    its arguments (OpenAI's `ChoiceDeltaToolCallFunction`)."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Wire):
    """A piece of one tool call (OpenAI's `ChoiceDeltaToolCall`): `index` names the call; `id`,
    `type` and the function's name come on its first delta only. `arguments_offset` (detok's,
    like `text_offset`) counts the characters of the call's arguments before this piece, so an
    at-least-once reader places a replayed piece as it places text."""

    index: Annotated[int, Field(ge=0)]
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None
    arguments_offset: Annotated[int, Field(ge=0)] = 0


class FunctionCall(_Wire):
    """A parsed call's function: its name and its arguments as a JSON string (OpenAI's)."""

    name: str
    arguments: str


class ToolCall(_Wire):
    """A parsed tool call in a completion (OpenAI's `ChatCompletionMessageToolCall`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


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
    logprobs: Logprobs | None = None
    # Chat outputs (docs/chat-outputs.md), for a request of a model with a reasoning or tool
    # parser: then `text` is the content alone, `reasoning` what the delta adds to the
    # reasoning (placed by `reasoning_offset`, as `text` by `text_offset`) and `tool_calls` the
    # pieces of calls. Absent (null) for other requests.
    reasoning: str | None = None
    reasoning_offset: Annotated[int, Field(ge=0)] | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_chat_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A request no parser reads writes no chat fields: three nulls were ~58 bytes on every
        # delta record (a quarter of a 16-token delta) for a feature it does not use.
        record = handler(self)
        if self.reasoning_offset is None:
            for name in _CHAT_DELTA_FIELDS:
                if record.get(name) is None:
                    record.pop(name, None)
        return record


_CHAT_DELTA_FIELDS = ("reasoning", "reasoning_offset", "tool_calls")


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
    # The stop string that ended the request (`finish_reason` is then "stop").
    stop_reason: str | None = None
    logprobs: Logprobs | None = None
    # Chat outputs (docs/chat-outputs.md), for a request of a model with a reasoning or tool
    # parser; then `text` is the content alone. `finish_reason` is "tool_calls" when a call was
    # parsed (as vLLM reports it); `reasoning_tokens` counts the generated ids inside reasoning
    # (OpenAI's `usage.completion_tokens_details.reasoning_tokens`).
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_tokens: Annotated[int, Field(ge=0)] | None = None


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


# --- Stop signals (issue 31 item 2) ---------------------------------------------------------


class StopSignal(_Wire):
    """A control record: the worker ended a live request before its finish event arrived.

    Written to the control topic (keyed by the request id) in the transaction of the request's
    completion, so an engine that cannot see stop strings (a tokens-only engine) learns it may
    abort the generation. A request that ends at its finish event gets none.
    """

    type: Literal["stop"] = "stop"
    request_id: RequestId
    model: ModelName
    # "stop_string", or the dead-letter reason the request failed with (strict_decode_failure,
    # output_too_large, ttl_expired, sequence_gap, ...).
    reason: Literal["stop_string"] | DeadLetterReason
    # Generated ids the completion used: for a stop string, up to the one whose text completed
    # it; every later id the engine made was wasted.
    generated_tokens: Annotated[int, Field(ge=0)]


class DeadLetterRecord(_Wire):
    """A dead letter as `detok run` writes it to its dead-letter file (one JSON line)."""

    type: Literal["dead_letter"] = "dead_letter"
    reason: DeadLetterReason
    error_class: str
    error: str
    line: int | None = None
    # A table input's row (counted from 0 across the file) where a text input has its line.
    row: int | None = None
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
    stop: StopStrings | None = None
    include_stop_str_in_output: bool = False
    output_logprobs: list[Logprob] | None = None
    output_top_logprobs: list[TopLogprobPairs] | None = None
    tools: Tools | None = None

    @model_validator(mode="after")
    def _aligned(self) -> LoggedGeneration:
        check_aligned(
            self.output_token_ids, self.output_logprobs, self.output_top_logprobs, "output_"
        )
        return self

    prompt_tokens: PromptTokens = None  # perfstate: prompt tails


WIRE_MODELS: dict[str, type[BaseModel]] = {
    "prompt-event": PromptEvent,
    "tokens-event": TokensEvent,
    "finish-event": FinishEvent,
    "text-delta": TextDelta,
    "completion": Completion,
    "filtered-ids-metric": FilteredIdsRecord,
    "stop-signal": StopSignal,
    "dead-letter-record": DeadLetterRecord,
    "logged-generation": LoggedGeneration,
}


def _model_fields(value: object) -> dict[str, object]:
    """A nested wire model (a completion's `logprobs`) is encoded as its fields, like the top."""
    if isinstance(value, BaseModel):
        return value.__dict__
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


# One msgspec encoder for every record detok writes itself (compact JSON, UTF-8 as is, the same
# bytes pydantic's `model_dump_json` writes for these plain values; a float with a positive
# exponent is spelled `1e17` rather than pydantic's `1e+17`, the same JSON number).
encode_json = msgspec.json.Encoder(enc_hook=_model_fields).encode


def dump_json(model: BaseModel) -> bytes:
    """`model.model_dump_json()`, ~5x faster: the worker writes one completion per request.

    A validated model holds exactly its fields, in declaration order, as plain JSON values (no
    aliases, no custom serializers in these models), so encoding them directly gives the same
    bytes; `tests/unit/test_schemas.py` holds the two encodings equal.
    """
    return encode_json(model.__dict__)
