"""Every dead-letter reason with the stage it happens at and the exception class it stands for.

One table, keyed by the enum, so that adding a reason means adding its row here (a test checks
that every `DeadLetterReason` has one): before, the stages lived in a string-keyed dict nobody
checked, and a missing key was a `KeyError` in the worker at the moment of the first such record.
`stage` fills the Kafka Connect `__connect.errors.stage` header; `error_class` is the class whose
name a dead letter of that reason carries unless the site knows a more precise one (the actual
exception for decode and unexpected errors).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from pydantic_core import ValidationError

from pipeline.decode_stream import StrictDecodeError
from pipeline.errors import (
    KeyMismatchError,
    OutputTooLargeError,
    PartitionMismatchError,
    RequestExpiredError,
    SequenceError,
    SnapshotError,
    TokenIdOutOfRangeError,
)
from pipeline.tokenizer_registry import UnknownModelError
from schemas.events import DeadLetterReason

Stage = Literal[
    "deserialize",
    "validate",
    "sequence",
    "decode",
    "upstream_failed",
    "ttl",
    "process",
    "produce",
    "restore",
]


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    """Where in the pipeline a reason arises, and which exception class names it."""

    stage: Stage
    error_class: type[Exception]

    @property
    def error_class_name(self) -> str:
        return self.error_class.__name__


REASONS: MappingProxyType[DeadLetterReason, ReasonInfo] = MappingProxyType(
    {
        DeadLetterReason.MALFORMED_JSON: ReasonInfo("deserialize", ValidationError),
        DeadLetterReason.SCHEMA_VIOLATION: ReasonInfo("validate", ValidationError),
        DeadLetterReason.TOKEN_ID_OUT_OF_RANGE: ReasonInfo("validate", TokenIdOutOfRangeError),
        DeadLetterReason.UNKNOWN_MODEL: ReasonInfo("validate", UnknownModelError),
        DeadLetterReason.MISSING_PROMPT: ReasonInfo("sequence", SequenceError),
        DeadLetterReason.EVENT_AFTER_FINISH: ReasonInfo("sequence", SequenceError),
        DeadLetterReason.SEQUENCE_GAP: ReasonInfo("sequence", SequenceError),
        DeadLetterReason.STRICT_DECODE_FAILURE: ReasonInfo("decode", StrictDecodeError),
        DeadLetterReason.REQUEST_ALREADY_FAILED: ReasonInfo("upstream_failed", SequenceError),
        DeadLetterReason.TTL_EXPIRED: ReasonInfo("ttl", RequestExpiredError),
        # The dead letter names the exception actually raised; `Exception` is only the default.
        DeadLetterReason.UNEXPECTED_ERROR: ReasonInfo("process", Exception),
        DeadLetterReason.OUTPUT_TOO_LARGE: ReasonInfo("produce", OutputTooLargeError),
        DeadLetterReason.RESTORE_FAILED: ReasonInfo("restore", SnapshotError),
        DeadLetterReason.KEY_MISMATCH: ReasonInfo("validate", KeyMismatchError),
        DeadLetterReason.PARTITION_MISMATCH: ReasonInfo("sequence", PartitionMismatchError),
    }
)
