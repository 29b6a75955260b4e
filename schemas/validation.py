"""Turning raw bytes into events, and a refusal into a dead-letter reason.

Kept apart from the models so that the one question every consumer asks ("is this record usable,
and if not, why?") has one answer, used by the Kafka worker and `detok run` alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from schemas.events import INPUT_EVENT_ADAPTER, DeadLetterReason
from schemas.fast_events import ParsedEvent, decode_event, event_from_json

_TOKEN_ID_FIELDS = frozenset(
    {"prompt_token_ids", "token_ids", "output_token_ids", "top_logprobs", "output_top_logprobs"}
)
_RANGE_ERRORS = frozenset({"greater_than_equal", "less_than_equal"})
# pydantic lists every failing element (a 100k-id chunk of strings: a multi-megabyte message);
# the first few kilobytes always name the cause, and the message travels in a header.
MAX_MESSAGE_CHARS = 4096

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why raw bytes could not become an event."""

    reason: DeadLetterReason
    error_class: str
    message: str


def classify(error: ValidationError) -> DeadLetterReason:
    """Name the dead-letter reason of a validation error.

    Ids outside [0, 2**32) get their own reason because they are the one schema error a healthy
    inference server can still produce (a sampling bug, an uninitialised slot), and dashboards
    want them apart from plain garbage.
    """
    errors = error.errors(include_url=False, include_context=False, include_input=False)
    if any(e["type"] in ("json_invalid", "json_type") for e in errors):
        return DeadLetterReason.MALFORMED_JSON
    if errors and all(
        e["type"] in _RANGE_ERRORS and _TOKEN_ID_FIELDS.intersection(map(str, e["loc"]))
        for e in errors
    ):
        return DeadLetterReason.TOKEN_ID_OUT_OF_RANGE
    return DeadLetterReason.SCHEMA_VIOLATION


def _rejection(error: ValidationError) -> Rejection:
    message = str(error)
    return Rejection(classify(error), "pydantic_core.ValidationError", message[:MAX_MESSAGE_CHARS])


def parse_event(raw: bytes | str) -> ParsedEvent | Rejection:
    """Parse one input record; never raises (MemoryError aside).

    The msgspec decoder takes every well-formed record; what it refuses (or fails on: a
    `RecursionError` from an array nested a thousand levels deep in an otherwise valid event)
    goes to the pydantic models, the contract, which either name the reason (that one is
    `malformed_json`, "recursion limit exceeded") or, for the few inputs the contract accepts
    and msgspec does not (a repeated key, `"seq": 0.0`), hand back the event after all. Any
    exception pydantic raises besides its verdict is a rejection too (`unexpected_error`): one
    record must never stop a worker, which would then stop on it again at every restart.
    """
    try:
        return decode_event(raw)
    except BaseException as error:  # a refusal or a failure: either way, the contract judges
        if not is_row_fault(error):
            raise
    try:
        model = INPUT_EVENT_ADAPTER.validate_json(raw)
        return event_from_json(model.model_dump(mode="json"))
    except ValidationError as error:
        return _rejection(error)
    except BaseException as error:  # the rule: any error of one record rejects that record
        if not is_row_fault(error):
            raise
        return _unexpected(error)


def parse_model(model: type[M] | TypeAdapter, raw: bytes | str) -> M | Rejection:
    """Parse raw JSON into any wire model; never raises (MemoryError aside)."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(raw)
        return model.model_validate_json(raw)
    except ValidationError as error:
        return _rejection(error)
    except BaseException as error:  # as in `parse_event`
        if not is_row_fault(error):
            raise
        return _unexpected(error)


def is_record_fault(error: BaseException) -> bool:
    """Whether an exception raised while handling one record is that record's to bear.

    Every `Exception` is; so is a panic inside a Rust extension (pydantic-core, `tokenizers`),
    which pyo3 raises as `PanicException`, a `BaseException` that cannot be imported by name: an
    extension that panics on one record must reject that record, not stop the worker, which
    would meet the same record at every restart. Interrupts and exits are never a record's.
    """
    return isinstance(error, Exception) or type(error).__name__ == "PanicException"


def is_row_fault(error: BaseException) -> bool:
    """Whether an exception met while reading or parsing one input row rejects that row alone:
    a record's fault (`is_record_fault`) other than running out of memory, which is the
    process's and must end it rather than dead-letter row after row."""
    return is_record_fault(error) and not isinstance(error, MemoryError)


def _unexpected(error: BaseException) -> Rejection:
    return Rejection(
        DeadLetterReason.UNEXPECTED_ERROR, type(error).__name__, str(error)[:MAX_MESSAGE_CHARS]
    )
