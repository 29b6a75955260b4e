"""The per-record exception rule: one bad record is set aside, never the stream.

Like Kafka Streams' deserialization and processing exception handlers, with one fixed policy:
any exception while parsing or processing one consumed record dead-letters that record (reason
`unexpected_error`, with the exception's class and message) and the stream goes on. Records that
break a rule of the input contract get the rule's own reason:

- bytes that are no event: the parser's reason (`malformed_json`, `schema_violation`, ...);
- a Kafka key that is not the event's request id: `key_mismatch` (the key decides the partition,
  and the partition decides who holds the request's state);
- an event of a request whose state lives on another input partition: `partition_mismatch`, for
  the events on the partition that does not own the request.

Only broker-level errors (fenced, not authorised, fatal producer errors) stop a worker; they are
raised elsewhere. This module needs no broker: it takes objects with the `confluent_kafka.Message`
interface, so tests feed it generated records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.dead_letter_reasons import REASONS
from pipeline.processor import BatchResult, DeadLetter
from schemas.events import DeadLetterReason
from schemas.fast_events import ParsedEvent
from schemas.validation import Rejection, parse_event
from workers.kafka.origin import KafkaOrigin

log = logging.getLogger("detok.worker")

# Exception messages go into a header cut to 4 KiB anyway; a message built from a huge input
# (a repr of a million-element list) is cut here first so building it costs nothing.
MAX_ERROR_TEXT = 4096


class ProcessorCalls(Protocol):
    """What record handling needs of the processor (contract 4)."""

    def process(self, batch: Sequence[tuple[ParsedEvent, Any]], now: float) -> BatchResult: ...
    def mark_failed(
        self, request_id: str, reason: DeadLetterReason, *, message: str | None = None
    ) -> BatchResult: ...


@dataclass
class HandledBatch:
    """One consumed batch, handled: what the processor produced and what was set aside."""

    result: BatchResult
    dead_letters: list[DeadLetter] = field(default_factory=list)
    records: int = 0
    events: int = 0  # records that became events and went to the processor
    # Input partition -> newest record timestamp (seconds) and next offset, per partition seen.
    newest_timestamp: dict[int, float] = field(default_factory=dict)
    next_offsets: dict[int, int] = field(default_factory=dict)
    # Requests that now have state, by the partition that owns them (only those: orphan events
    # create none, so they never grow the owner map).
    new_owners: dict[str, int] = field(default_factory=dict)


def unexpected(error: BaseException, origin: Any, request_id: str | None, seq: Any) -> DeadLetter:
    message = str(error)[:MAX_ERROR_TEXT]
    return DeadLetter(
        DeadLetterReason.UNEXPECTED_ERROR,
        type(error).__name__,
        message or type(error).__name__,
        request_id,
        seq if isinstance(seq, int) else None,
        origin,
    )


def parse_record(
    message: Any, owner_of: Callable[[str], int | None]
) -> tuple[ParsedEvent, KafkaOrigin] | DeadLetter:
    """One consumed record as an event, or the dead letter that sets it aside. Never raises."""
    origin = KafkaOrigin(message)
    request_id: str | None = None
    seq = None
    try:
        event = parse_event(message.value() or b"")
        if isinstance(event, Rejection):
            return DeadLetter(event.reason, event.error_class, event.message, None, None, origin)
        request_id, seq = event.request_id, event.seq
        key = message.key()
        if key is not None and key != request_id.encode():
            return DeadLetter(
                DeadLetterReason.KEY_MISMATCH,
                REASONS[DeadLetterReason.KEY_MISMATCH].error_class_name,
                f"record key {key[:200]!r} is not the event's request_id {request_id!r}",
                request_id,
                seq,
                origin,
            )
        owner = owner_of(request_id)
        partition = message.partition()
        if owner is not None and owner != partition:
            return DeadLetter(
                DeadLetterReason.PARTITION_MISMATCH,
                REASONS[DeadLetterReason.PARTITION_MISMATCH].error_class_name,
                f"request {request_id!r} is owned by input partition {owner}, "
                f"this event came on partition {partition}",
                request_id,
                seq,
                origin,
            )
        return event, origin
    except MemoryError:
        raise
    except Exception as error:
        return unexpected(error, origin, request_id, seq)


def handle_batch(
    messages: Sequence[Any], processor: ProcessorCalls, owners: dict[str, int], now: float
) -> HandledBatch:
    """Parse, check and process one consumed batch. Never raises for what a record contains.

    `owners` (request id -> input partition) is read, not written: the caller adds
    `new_owners` once it has taken the batch.
    """
    handled = HandledBatch(BatchResult())
    claimed: dict[str, int] = {}  # first partition of a prompt per request without an owner

    def owner_of(request_id: str) -> int | None:
        owner = owners.get(request_id)
        return owner if owner is not None else claimed.get(request_id)

    batch: list[tuple[ParsedEvent, KafkaOrigin]] = []
    for message in messages:
        partition = message.partition()
        handled.records += 1
        handled.next_offsets[partition] = message.offset() + 1
        timestamp_ms = _timestamp_ms(message)
        if timestamp_ms is not None:
            seconds = timestamp_ms / 1000
            if seconds > handled.newest_timestamp.get(partition, float("-inf")):
                handled.newest_timestamp[partition] = seconds
        parsed = parse_record(message, owner_of)
        if isinstance(parsed, DeadLetter):
            handled.dead_letters.append(parsed)
            continue
        if parsed[0].type == "prompt":
            # Only a prompt can give a request state, so only a prompt claims it for its
            # partition: an orphan event consumed first must not turn the prompt away.
            claimed.setdefault(parsed[0].request_id, partition)
        batch.append(parsed)
    handled.events = len(batch)
    if batch:
        handled.result = process_guarded(processor, batch, now, handled.dead_letters)
    for request_id in handled.result.touched:
        partition = claimed.get(request_id)
        if partition is not None and request_id not in owners:
            handled.new_owners[request_id] = partition
    return handled


def process_guarded(
    processor: ProcessorCalls,
    batch: list[tuple[ParsedEvent, Any]],
    now: float,
    dead_letters: list[DeadLetter],
) -> BatchResult:
    """`processor.process(batch)`; if that raises, event by event, so only the events that
    raise are set aside (as `unexpected_error`, their request marked failed)."""
    try:
        return processor.process(batch, now)
    except MemoryError:
        raise
    except Exception as error:
        log.warning("a batch raised %r; processing its %d events one by one", error, len(batch))
    # The processor decodes a batch in one round; a failure inside it does not say which event
    # caused it. Processing the events one by one does (and costs only on this rare path).
    merged = BatchResult()
    for event, origin in batch:
        try:
            merged.merge(processor.process([(event, origin)], now))
        except MemoryError:
            raise
        except Exception as error:
            dead_letters.append(unexpected(error, origin, event.request_id, event.seq))
            failed = processor.mark_failed(
                event.request_id, DeadLetterReason.UNEXPECTED_ERROR, message=f"{error!r}"
            )
            merged.merge(failed)  # its failed completion, its held events
    return merged


def _timestamp_ms(message: Any) -> int | None:
    try:
        kind, value = message.timestamp()
    except Exception:
        return None
    return value if kind and isinstance(value, int) and value > 0 else None
